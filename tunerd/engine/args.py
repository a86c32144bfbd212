"""Settings ↔ vLLM flags, for the allowlisted tunables only, in vLLM 0.33's spellings. Pure.

tunerd owns the tunables (:data:`tunerd.tune.TUNABLES`) and appends them, with
``--shutdown-timeout``, to the operator's ``command``; a tunable written into ``command`` is a
config error (two owners of one flag). Booleans are ``--x`` / ``--no-x`` (vLLM's
``BooleanOptionalAction``). tunerd never emits ``--disable-log-stats`` (it removes every
``vllm:`` metric) or flags vLLM removed (``--swap-space``, ``--disable-log-requests``,
``--preemption-mode``). :func:`settings_from_argv` reads the tunables back from a running
engine's argv (for adoption), :func:`settings_from_cache_config` from its
``vllm:cache_config_info`` labels.

Flags are read as vLLM's parser reads them: ``--max_num_seqs`` is ``--max-num-seqs``
(``FlexibleArgumentParser`` turns ``_`` into ``-`` in a flag's name) and so is an unambiguous
prefix such as ``--max-num-seq`` (argparse's ``allow_abbrev``). A prefix of several flags tunerd
owns, or of one tunerd owns and another, is refused in a command too: vLLM would either read it
as a flag tunerd owns or stop on it as ambiguous. In vLLM 0.32's parser no flag is itself a
proper prefix of a flag tunerd owns, so an exact vLLM flag is never mistaken for one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from tunerd.tune import BOOLEAN_TUNABLES, INTEGER_TUNABLES, TUNABLES, validate_value

__all__ = [
    "FLAGS",
    "FORBIDDEN_FLAGS",
    "ArgsError",
    "command_problems",
    "engine_argv",
    "settings_from_argv",
    "settings_from_cache_config",
    "settings_to_args",
    "without_tunables",
]

#: knob → vLLM 0.33 flag.
FLAGS: dict[str, str] = {knob: "--" + knob.replace("_", "-") for knob in TUNABLES}
#: Flags tunerd never passes, and refuses in an engine's command.
FORBIDDEN_FLAGS = {
    "--disable-log-stats": "it removes every vllm: metric tunerd reads",
    "--swap-space": "removed in vLLM 0.18",
    "--disable-log-requests": "removed; vLLM 0.33 rejects it",
    "--preemption-mode": "V0 only; vLLM 0.33 rejects it",
}
_FLAG_TO_KNOB = {flag: knob for knob, flag in FLAGS.items()}
_NEGATED = {
    "--no-" + flag.removeprefix("--"): knob for knob, flag in FLAGS.items() if knob in BOOLEAN_TUNABLES
}
_SHUTDOWN_TIMEOUT = "--shutdown-timeout"
#: The flags tunerd owns or refuses that vLLM still has: what an abbreviation may stand for.
_ABBREVIABLE = (*_FLAG_TO_KNOB, *_NEGATED, "--disable-log-stats", _SHUTDOWN_TIMEOUT)


class ArgsError(ValueError):
    """Settings that cannot become vLLM flags; the message names the knob."""


def _format(knob: str, value: Any) -> str:
    if knob == "gpu_memory_utilization":
        return f"{float(value):.4g}"
    if knob in INTEGER_TUNABLES:
        return str(int(value))
    return str(value)


def settings_to_args(settings: Mapping[str, Any]) -> list[str]:
    """The flags for ``settings`` (tunables only, in a fixed order); None values are omitted
    (vLLM's default applies)."""
    unknown = sorted(set(settings) - set(TUNABLES))
    if unknown:
        raise ArgsError(f"not tunables: {', '.join(unknown)}")
    args: list[str] = []
    for knob in TUNABLES:
        value = settings.get(knob)
        if value is None:
            continue
        problem = validate_value(knob, value)
        if problem is not None:
            raise ArgsError(problem)
        flag = FLAGS[knob]
        if knob in BOOLEAN_TUNABLES:
            args.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            args += [flag, _format(knob, value)]
    return args


def engine_argv(command: Sequence[str], settings: Mapping[str, Any], shutdown_timeout: float) -> list[str]:
    """The engine's whole argv: the operator's command, the tunables, the drain timeout."""
    problems = command_problems(command)
    if problems:
        raise ArgsError(problems[0])
    return [*command, *settings_to_args(settings), "--shutdown-timeout", f"{shutdown_timeout:g}"]


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _candidates(arg: str) -> list[str]:
    """The flags tunerd owns or refuses that vLLM reads ``arg`` as (its name before ``=``):
    one for an exact spelling (``_`` or ``-``) or an unambiguous prefix, several for an
    ambiguous prefix of them, none for any other argument."""
    name = _flag_name(arg)
    if not name.startswith("--") or len(name) <= 2:  # a value, a short flag, or "--" itself
        return []
    name = "--" + name[2:].replace("_", "-")
    if name in _FLAG_TO_KNOB or name in _NEGATED or name in FORBIDDEN_FLAGS or name == _SHUTDOWN_TIMEOUT:
        return [name]
    return [flag for flag in _ABBREVIABLE if flag.startswith(name)]


def _owned_flag(arg: str) -> str | None:
    """The flag tunerd owns or refuses that vLLM reads ``arg`` as, if exactly one."""
    candidates = _candidates(arg)
    return candidates[0] if len(candidates) == 1 else None


def command_problems(command: Sequence[str]) -> list[str]:
    """Why ``command`` cannot be an engine command: tunables tunerd owns, forbidden flags,
    a drain timeout tunerd sets itself — in any spelling vLLM reads as one of them."""
    problems = []
    for arg in command:
        candidates = _candidates(arg)
        if not candidates:
            continue
        written = _flag_name(arg)
        if len(candidates) > 1:
            problems.append(
                f"{written} is an abbreviation vLLM reads as one of {', '.join(candidates)} "
                "(or refuses as ambiguous): tunerd sets those; write the whole name of the flag you mean"
            )
            continue
        [flag] = candidates
        if written == flag:
            name = flag
        elif "--" + written[2:].replace("_", "-") == flag:
            name = f"{written} (vLLM reads it as {flag})"
        else:
            name = f"{written} (an abbreviation of {flag})"
        knob = _FLAG_TO_KNOB.get(flag) or _NEGATED.get(flag)
        if knob is not None:
            problems.append(
                f"{name} is tuned by tunerd: set {knob} under the engine's settings, not in command"
            )
        elif flag in FORBIDDEN_FLAGS:
            problems.append(f"{name} is not allowed in command: {FORBIDDEN_FLAGS[flag]}")
        else:
            problems.append(f"{name} is set by tunerd from the restart's drain time")
    return problems


def _parse(knob: str, text: str) -> Any:
    if knob == "gpu_memory_utilization":
        return float(text)
    if knob in INTEGER_TUNABLES:
        return int(text)
    return text


def settings_from_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The tunables an engine was started with (``--flag value``, ``--flag=value``,
    ``--x``/``--no-x``); later flags win, as in argparse. Unparsable values are skipped."""
    settings: dict[str, Any] = {}
    position = 0
    while position < len(argv):
        arg = argv[position]
        inline = arg.partition("=")[2]
        name = _owned_flag(arg)
        position += 1
        if name in _NEGATED:
            settings[_NEGATED[name]] = False
            continue
        knob = _FLAG_TO_KNOB.get(name or "")
        if knob is None:
            continue
        if knob in BOOLEAN_TUNABLES:
            settings[knob] = True
            continue
        value = inline if arg.count("=") else (argv[position] if position < len(argv) else None)
        if not arg.count("="):
            position += 1
        if value is None:
            continue
        try:
            settings[knob] = _parse(knob, value)
        except ValueError:
            continue
    return settings


def without_tunables(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` without the flags tunerd owns (the tunables and ``--shutdown-timeout``, with
    their values): what is left names the program and the model — two engines whose argv
    differ only here run the same command."""
    kept: list[str] = []
    position = 0
    while position < len(argv):
        arg = argv[position]
        name = _owned_flag(arg) or ""
        position += 1
        knob = _FLAG_TO_KNOB.get(name)
        if name in _NEGATED or (knob is not None and knob in BOOLEAN_TUNABLES):
            continue
        if knob is not None or name == _SHUTDOWN_TIMEOUT:
            if "=" not in arg:
                position += 1  # its value
            continue
        kept.append(arg)
    return tuple(kept)


def settings_from_cache_config(labels: Mapping[str, str]) -> dict[str, Any]:
    """What ``vllm:cache_config_info`` tells of the running settings (a partial set)."""
    settings: dict[str, Any] = {}
    utilization = labels.get("gpu_memory_utilization")
    if utilization is not None and utilization != "None":
        with contextlib.suppress(ValueError):
            settings["gpu_memory_utilization"] = float(utilization)
    dtype = labels.get("cache_dtype")
    if dtype not in (None, "None"):
        settings["kv_cache_dtype"] = dtype
    memory = labels.get("kv_cache_memory_bytes")
    if memory not in (None, "None") and str(memory).isdigit():
        settings["kv_cache_memory_bytes"] = int(memory)
    prefix = labels.get("enable_prefix_caching")
    if prefix in ("True", "False"):
        settings["enable_prefix_caching"] = prefix == "True"
    return settings
