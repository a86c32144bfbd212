"""tunerd's config file (DESIGN §4.8): engines, sources, mode, policies, guards, state.

Loaded with :func:`tunerd.yamlfile.load_yaml`, so every problem comes back as
``file:line: path: message``; all problems at once, never the first only; a value of the wrong
type is one of them, never an exception. Checked beyond the schema: settings and bounds name
allowlisted tunables with values in their ranges (bounds ``[low, high]``), a tunable or a
forbidden flag written in ``command`` is refused in any spelling vLLM reads (tunerd owns it),
engine names are unique, a single ``engine:`` block is shorthand for a list of one. Numbers and
booleans are strict (``true`` is not 1), durations are at most 30 days, URLs are ``http(s)``
to a host, ``listen.metrics`` is ``HOST:PORT``, environment names are names, and no string
holds a NUL. Policy globs are resolved relative to the config file; one that matches no file is
refused.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tunerd.engine.args import command_problems
from tunerd.notify.sink import Target
from tunerd.paths import DEFAULT_CONFIG, RUN_DIR
from tunerd.planner.calibration import DEFAULT_CREEP, DEFAULT_MARGIN_BYTES
from tunerd.policy.schema import Duration, PositiveDuration, Size
from tunerd.tune import TUNABLES, bounds_problem, validate_value
from tunerd.units import parse_duration
from tunerd.yamlfile import Problem, YamlError, load_yaml, located

__all__ = [
    "DEFAULT_CONFIG",
    "Config",
    "ConfigError",
    "EngineConfig",
    "NotifyConfig",
    "load_config",
    "notify_targets",
    "rate_of",
]

HOOKS = ("pre_stop", "post_start")


class ConfigError(Exception):
    """The config did not load; ``problems`` are located one-line messages."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _gpu(value: Any) -> Any:
    index = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if not index and not (isinstance(value, str) and value.strip()):
        raise ValueError(f"expected a GPU's index (0, 1, ...) or UUID, got {value!r}")
    return value


Gpu = Annotated[int | str, BeforeValidator(_gpu)]


class GateQueueConfig(_Strict):
    max_requests: int = Field(default=256, ge=0)
    max_tokens: int = Field(default=2_000_000, ge=0)  # KV need of the requests waiting
    max_wait: PositiveDuration = 120.0


class GateHoldConfig(_Strict):
    max: PositiveDuration = 600.0  # the longest a restart may hold new requests


class GateConfig(_Strict):
    """``engines[].gate``: the KV-aware admission proxy in front of this engine (DESIGN §9.1,
    docs/gate.md). ``tunerd gate`` serves it; tunerd tells it to hold across restarts."""

    listen: str  # HOST:PORT the clients talk to
    target_fraction: float = Field(default=0.90, gt=0, le=1)
    long_threshold: int = Field(default=16384, ge=1)
    long_lane: int = Field(default=1, ge=1)
    max_concurrency: int = Field(default=0, ge=0)
    queue: GateQueueConfig = Field(default_factory=GateQueueConfig)
    hold: GateHoldConfig = Field(default_factory=GateHoldConfig)
    control: str | None = None  # the control socket; default /run/tunerd/gate.sock
    max_body: Size = 64 << 20  # a request body larger than this is refused (413)
    priority_header: str = Field(default="X-Tunerd-Priority", min_length=1)

    @field_validator("listen")
    @classmethod
    def _address(cls, value: str) -> str:
        why = address_problem(value)
        if why is not None:
            raise ValueError(why)
        return value


class EngineConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    control: Literal["supervise", "systemd"] = "supervise"
    command: list[str] = Field(default_factory=list)  # supervise mode; systemd: the unit's ExecStart
    env: dict[str, str] = Field(default_factory=dict)
    unit: str | None = None
    url: str = "http://127.0.0.1:8000"
    gpus: list[Gpu] = Field(default_factory=lambda: list[int | str]([0]))
    settings: dict[str, Any] = Field(default_factory=dict)
    bounds: dict[str, list[Any]] = Field(default_factory=dict)
    ladders: dict[str, list[Any]] = Field(default_factory=dict)  # a knob's rungs replace its notches
    model: dict[str, Any] | None = None
    hooks: dict[str, list[str]] = Field(default_factory=dict)
    drain: Duration = 120.0  # --shutdown-timeout and the longest drain
    startup_timeout: PositiveDuration = 900.0
    probation: Duration = 300.0
    hook_timeout: PositiveDuration = 60.0  # each pre_stop / post_start run
    gpu_wait: Duration = 120.0  # after a stop, for the memory the new settings need
    log_passthrough: Literal["warnings", "all", "none"] = "warnings"  # engine lines into tunerd's log
    gate: GateConfig | None = None


class GpuConfig(_Strict):
    source: Literal["nvml", "nvidia-smi", "sim", "none"] = "nvml"
    url: str | None = None
    interval: PositiveDuration = 0.25


class MetricsConfig(_Strict):
    interval: PositiveDuration = 2.0


class ClockConfig(_Strict):
    source: Literal["system", "sim"] = "system"
    url: str | None = None


class QuietConfig(_Strict):
    max_running: int = Field(default=0, ge=0)
    for_: Duration = Field(default=120.0, alias="for")
    within: Duration = 3600.0  # how long a quiet restart waits before it alerts instead


class GuardsConfig(_Strict):
    max_restarts: int = Field(default=3, ge=1)
    window: PositiveDuration = 3600.0
    on_exhausted: Literal["hold", "skip"] = "hold"
    quiet: QuietConfig = Field(default_factory=QuietConfig)
    settle: Duration = 900.0
    shared_gpu_max: float = Field(default=0.95, gt=0, le=1)  # engines sharing a GPU: summed utilization


class NotifyConfig(_Strict):
    """One chat sink (DESIGN §4.8): where (``url_env``, the name of the variable holding the
    URL — tokens live in it — or ``url``), how to sign (``secret_env``), the language, the least
    severity it gets, and optionally its own rate limit (``rate: 20/1m``; default the service's)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    kind: Literal["feishu", "dingtalk", "wecom", "slack", "teams", "discord", "webhook", "alertmanager"]
    url_env: str | None = None
    url: str | None = None
    secret_env: str | None = None
    language: Literal["en", "zh"] = "en"
    min_severity: Literal["info", "warning", "critical"] = "info"
    rate: str | None = None

    @model_validator(mode="after")
    def _one_url(self) -> NotifyConfig:
        if (self.url_env is None) == (self.url is None):
            raise ValueError("give the URL as url_env: (a variable's name) or url:, one of them")
        if self.rate is not None:
            rate_of(self.rate)
        return self


def rate_of(text: str) -> tuple[int, float]:
    """``20/1m`` → (20, 60.0): messages per duration."""
    count, _, per = text.partition("/")
    try:
        messages, seconds = int(count), parse_duration(per or "1s")
    except ValueError:
        raise ValueError(f"rate is MESSAGES/DURATION such as 20/1m, not {text!r}") from None
    if messages < 1 or seconds <= 0:
        raise ValueError(f"rate needs at least 1 message per a positive duration, not {text!r}")
    return messages, seconds


class FitConfig(_Strict):
    """What a computed ``fit`` leaves free besides the observed peak and the neighbours:
    ``margin`` bytes, and ``creep`` × the activation peak for the allocator's creep still to
    come (docs/policies.md, "Computed moves")."""

    margin: Size = DEFAULT_MARGIN_BYTES
    creep: float = Field(default=DEFAULT_CREEP, ge=0, le=2)


class Config(_Strict):
    engines: list[EngineConfig] = Field(min_length=1)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    clock: ClockConfig = Field(default_factory=ClockConfig)
    mode: Literal["observe", "advise", "act"] = "advise"
    policies: list[str] = Field(default_factory=lambda: ["/etc/tunerd/policies/*.yaml"])
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    fit: FitConfig = Field(default_factory=FitConfig)
    notify: list[NotifyConfig] = Field(default_factory=list)
    state_dir: str = "/var/lib/tunerd"
    listen: dict[str, str] = Field(default_factory=dict)
    source_file: str = ""

    def metrics_link(self, host: str) -> str | None:
        """tunerd's ``/metrics`` page as another machine reaches it (an alert's link), or None
        when it listens on this machine only (loopback) or not at all."""
        address = self.listen.get("metrics")
        if not address:
            return None
        bind, _, port = address.rpartition(":")
        bind = bind.strip("[]")
        if bind in ("127.0.0.1", "::1", "localhost") or bind.startswith("127.") or port in ("", "0"):
            return None
        where = host if bind in ("0.0.0.0", "::", "") else bind
        return f"http://{'[' + where + ']' if ':' in where else where}:{port}/metrics"

    def status_socket(self) -> Path:
        """Where the status API listens: ``listen.status``; else ``/run/tunerd/tunerd.sock``
        when that folder exists (systemd's ``RuntimeDirectory=`` makes it); else
        ``STATE_DIR/tunerd.sock``. ``tunerd status`` finds it by the same rule."""
        if "status" in self.listen:
            return Path(self.listen["status"])
        if RUN_DIR.is_dir():
            return RUN_DIR / "tunerd.sock"
        return Path(self.state_dir) / "tunerd.sock"

    def gate_control(self) -> Path:
        """Where the gate's control socket is: the first ``gate.control`` given; else
        ``/run/tunerd/gate.sock`` when that folder exists; else ``STATE_DIR/gate.sock``. One
        ``tunerd gate`` serves every engine's gate and answers on this one socket."""
        for engine in self.engines:
            if engine.gate is not None and engine.gate.control:
                return Path(engine.gate.control)
        if RUN_DIR.is_dir():
            return RUN_DIR / "gate.sock"
        return Path(self.state_dir) / "gate.sock"

    def gated(self) -> list[EngineConfig]:
        """The engines that have a gate."""
        return [engine for engine in self.engines if engine.gate is not None]

    def policy_files(self) -> list[Path]:
        """The policy globs, relative to the config file's folder, sorted and de-duplicated."""
        base = Path(self.source_file).parent if self.source_file else Path.cwd()
        found: list[Path] = []
        for pattern in self.policies:
            full = pattern if Path(pattern).is_absolute() else str(base / pattern)
            matches = sorted(glob.glob(full)) if glob.has_magic(full) else [full]
            found += [Path(match) for match in matches if Path(match) not in found]
        return found


def _pydantic_problems(error: ValidationError, prefix: tuple[str | int, ...]) -> list[Problem]:
    problems = []
    for item in error.errors():
        path = (
            *prefix,
            *(
                part
                for part in item["loc"]
                if not str(part).startswith(("function-", "literal", "[key]", "constrained-"))
            ),
        )
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        elif item["type"].endswith("_type"):  # strict: a bool is no number, a number no string
            shown = repr(item.get("input"))
            message += f", got {shown if len(shown) <= 40 else shown[:37] + '...'}"
        problems.append(Problem(tuple(path), message))
    return problems


_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_ENV_NAME_HELP = "a variable's name (no '=', no NUL), e.g. HF_HUB_OFFLINE"
LISTEN_KEYS = ("status", "metrics")


def _host_problem(host: str) -> str | None:
    """Why ``host`` (as written in a URL or HOST:PORT, IPv6 in brackets) is not a host."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"'{host}' is not an IPv6 address"
        return None
    if not host:
        return "no host"
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        return f"'{host}' is not a host name or address"
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an ``http(s)://HOST[:PORT]/…`` URL (None when it is). Never quotes the
    whole URL: a token may be part of it."""
    expected = "expected an http:// or https:// URL to a host"
    if any(char.isspace() or not char.isprintable() for char in url):
        return f"{expected}: it holds spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        return f"{expected}: {error}"
    if parts.scheme not in ("http", "https"):
        return (
            f"{expected}, not a {parts.scheme}: URL"
            if parts.scheme
            else f"{expected}, e.g. https://HOST/PATH"
        )
    hostport = parts.netloc.rpartition("@")[2]
    host = hostport[: hostport.index("]") + 1] if hostport.startswith("[") else hostport.partition(":")[0]
    if (why := _host_problem(host)) is not None:
        return f"{expected}: {why}"
    if port == 0:
        return f"{expected}: port 0"
    return None


def address_problem(address: str) -> str | None:
    """Why ``address`` is not ``HOST:PORT`` (port 0 to 65535; 0 picks a free one; an IPv6
    host in brackets) for tunerd to listen on."""
    expected = f"expected HOST:PORT such as 127.0.0.1:9464 or [::1]:9464, got {address!r}"
    host, colon, port = address.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return expected
    if ":" in host and not host.startswith("["):  # an IPv6 address without its brackets
        host = f"[{host}]"
    why = _host_problem(host)
    return None if why is None else f"{expected}: {why}"


def _nul_problems(data: Any, path: tuple[str | int, ...] = ()) -> list[Problem]:
    """Every string (key or value) holding a NUL: no argv, path or environment can carry one."""
    if isinstance(data, str):
        return [Problem(path, "a NUL character (\\0) is not accepted")] if "\0" in data else []
    problems: list[Problem] = []
    if isinstance(data, dict):
        for key, value in data.items():
            child = (*path, key if isinstance(key, str | int) else str(key))
            if isinstance(key, str) and "\0" in key:
                problems.append(Problem(child, "a NUL character (\\0) is not accepted in a name"))
            problems += _nul_problems(value, child)
    elif isinstance(data, list):
        for index, item in enumerate(data):
            problems += _nul_problems(item, (*path, index))
    return problems


def _listen_problems(raw: Any) -> list[Problem]:
    """``listen``: only ``status`` (a socket path) and ``metrics`` (HOST:PORT)."""
    if not isinstance(raw, dict):
        return []  # the schema says what it should be
    problems = [
        Problem(("listen", str(key)), f"unknown field (allowed: {', '.join(LISTEN_KEYS)})")
        for key in raw
        if key not in LISTEN_KEYS
    ]
    status, metrics = raw.get("status"), raw.get("metrics")
    if isinstance(status, str) and not status.strip():
        problems.append(Problem(("listen", "status"), "expected the status socket's path"))
    if isinstance(metrics, str) and (why := address_problem(metrics)) is not None:
        problems.append(Problem(("listen", "metrics"), why))
    return problems


def _notify_problems(raw: Any, environ: Mapping[str, str]) -> list[Problem]:
    """What the schema cannot see: the variables named are set, names are unique, the URL is an
    http(s) URL to a host, a Teams URL is not a retired connector. Values of the wrong type
    are left to the schema."""
    problems: list[Problem] = []
    if not isinstance(raw, list):
        return problems
    seen: set[str] = set()
    for index, sink in enumerate(raw):
        if not isinstance(sink, dict):
            continue
        name = sink.get("name")
        if isinstance(name, str):
            if name in seen:
                problems.append(Problem(("notify", index, "name"), f"duplicate sink name '{name}'"))
            seen.add(name)
        for key in ("url_env", "secret_env"):
            variable = sink.get(key)
            if isinstance(variable, str) and not environ.get(variable):
                problems.append(
                    Problem(("notify", index, key), f"{variable} is not set in tunerd's environment")
                )
        url, where = sink.get("url"), "url"
        if url is None and isinstance(sink.get("url_env"), str):
            url, where = environ.get(sink["url_env"]) or None, "url_env"
        if not isinstance(url, str):
            continue
        if (why := url_problem(url)) is not None:
            held = f"{sink['url_env']} holds no usable URL: " if where == "url_env" else ""
            problems.append(Problem(("notify", index, where), held + why))
        elif sink.get("kind") == "teams" and "webhook.office.com" in url:
            problems.append(
                Problem(
                    ("notify", index, "kind"),
                    "Office 365 connector URLs (*.webhook.office.com) are retired: use a Teams Workflows URL",
                )
            )
    return problems


def notify_targets(config: Config, environ: Mapping[str, str]) -> list[Target]:
    """The sinks with their URLs and secrets read from ``environ`` (never kept in the config)."""
    return [
        Target(
            name=sink.name,
            kind=sink.kind,
            url=sink.url or environ.get(sink.url_env or "", ""),
            secret=environ.get(sink.secret_env) if sink.secret_env else None,
            language=sink.language,
            min_severity=sink.min_severity,
        )
        for sink in config.notify
    ]


def _engine_problems(raw: dict[str, Any], path: tuple[str | int, ...]) -> list[Problem]:
    problems = []
    command = raw.get("command")
    if isinstance(command, list):
        for index, arg in enumerate(command):
            for message in command_problems([str(arg)]):
                problems.append(Problem((*path, "command", index), message))
    elif isinstance(command, str):
        problems.append(
            Problem((*path, "command"), "an argv list, never a shell string: [vllm, serve, MODEL]")
        )
    for section in ("settings", "bounds", "ladders"):
        values = raw.get(section)
        if not isinstance(values, dict):
            continue
        for knob, value in values.items():
            if knob not in TUNABLES:
                problems.append(
                    Problem((*path, section, knob), f"not a tunable (tunables: {', '.join(TUNABLES)})")
                )
            elif section == "settings" and (why := validate_value(knob, value)):
                problems.append(Problem((*path, section, knob), why))
            elif section in ("bounds", "ladders"):
                if not isinstance(value, list) or not value:
                    expected = (
                        bounds_problem(knob, value) if section == "bounds" else "expected a list of rungs"
                    )
                    problems.append(Problem((*path, section, knob), str(expected)))
                    continue
                items = [
                    Problem((*path, section, knob, position), why)
                    for position, item in enumerate(value)
                    if (why := validate_value(knob, item))
                ]
                problems += items
                if section == "bounds" and not items and (why := bounds_problem(knob, value)):
                    problems.append(Problem((*path, section, knob), why))
    env = raw.get("env")
    if isinstance(env, dict):
        for variable in env:
            if isinstance(variable, str) and (not variable or "=" in variable):
                problems.append(Problem((*path, "env", variable), f"expected {_ENV_NAME_HELP}"))
    url = raw.get("url")
    if isinstance(url, str) and (why := url_problem(url)) is not None:
        problems.append(Problem((*path, "url"), why))
    hooks = raw.get("hooks")
    if isinstance(hooks, dict):
        for hook, argv in hooks.items():
            if hook not in HOOKS:
                problems.append(Problem((*path, "hooks", hook), f"not a hook (hooks: {', '.join(HOOKS)})"))
            elif isinstance(argv, str):
                problems.append(Problem((*path, "hooks", hook), "an argv list, never a shell string"))
            elif isinstance(argv, list) and not argv:
                problems.append(Problem((*path, "hooks", hook), "an empty command"))
    if raw.get("control") == "systemd":
        if not raw.get("unit"):
            problems.append(Problem((*path, "unit"), "systemd control needs the engine's unit"))
        if raw.get("command"):
            problems.append(
                Problem(
                    (*path, "command"),
                    "systemd control: the command is the unit's ExecStart, ending in $TUNERD_ARGS "
                    "(docs/systemd-mode.md); remove it here",
                )
            )
        if raw.get("env"):
            problems.append(Problem((*path, "env"), "systemd control: set the environment in the unit"))
    elif not raw.get("command"):
        problems.append(Problem((*path, "command"), "the engine's argv list, e.g. [vllm, serve, MODEL]"))
    gate = raw.get("gate")
    listen = gate.get("listen") if isinstance(gate, dict) else None
    if isinstance(listen, str) and isinstance(url, str) and _same_address(listen, url):
        problems.append(
            Problem((*path, "gate", "listen"), "the gate cannot listen where the engine does (engines[].url)")
        )
    return problems


def _same_address(listen: str, url: str) -> bool:
    """Whether HOST:PORT ``listen`` is the host and port of ``url``."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    host, _, listen_port = listen.rpartition(":")
    return listen_port == str(port) and host.strip("[]") == (parts.hostname or "")


def load_config(path: str | Path, text: str | None = None) -> Config:
    try:
        source = load_yaml(path, text)
    except YamlError as error:
        raise ConfigError(str(error).splitlines()) from None
    data = source.data
    if not isinstance(data, dict):
        raise ConfigError([f"{path}:1: expected a mapping with engines: (see docs/config.md)"])
    data = dict(data)
    problems: list[Problem] = []
    if "engine" in data:
        if "engines" in data:
            problems.append(Problem(("engine",), "use engine: (one) or engines: (a list), not both"))
        else:
            source.lines.update(
                {
                    ("engines", 0, *key[1:]): line
                    for key, line in source.lines.items()
                    if key[:1] == ("engine",)
                }
            )
            data["engines"] = [data.pop("engine")]
    engines = data.get("engines")
    if isinstance(engines, list):
        seen: dict[str, int] = {}
        for index, raw in enumerate(engines):
            if isinstance(raw, dict):
                problems += _engine_problems(raw, ("engines", index))
                name = raw.get("name")
                if isinstance(name, str):
                    if name in seen:
                        problems.append(
                            Problem(
                                ("engines", index, "name"),
                                f"duplicate engine name (first at engines[{seen[name]}])",
                            )
                        )
                    seen.setdefault(name, index)
        listens: dict[str, int] = {}
        for index, raw in enumerate(engines):
            gate = raw.get("gate") if isinstance(raw, dict) else None
            listen = gate.get("listen") if isinstance(gate, dict) else None
            if isinstance(listen, str):
                if listen in listens:
                    problems.append(
                        Problem(
                            ("engines", index, "gate", "listen"),
                            f"another gate listens there (engines[{listens[listen]}])",
                        )
                    )
                listens.setdefault(listen, index)
    for block in ("gpu", "clock"):  # both read the simulator when their source is sim
        raw = data.get(block)
        if isinstance(raw, dict):
            if raw.get("source") == "sim" and not raw.get("url"):
                problems.append(Problem((block, "source"), "source: sim needs url: (the simulator's URL)"))
            elif raw.get("url") and raw.get("source") != "sim":
                problems.append(Problem((block, "url"), "url: is only for source: sim"))
            elif isinstance(raw.get("url"), str) and (why := url_problem(raw["url"])) is not None:
                problems.append(Problem((block, "url"), why))
    problems += _notify_problems(data.get("notify"), os.environ)
    problems += _listen_problems(data.get("listen"))
    problems += _nul_problems(data)
    config = None
    try:
        config = Config.model_validate({**data, "source_file": str(path)})
    except ValidationError as error:
        problems += _pydantic_problems(error, ())
    if config is not None and not problems and "policies" in data:
        problems += _unmatched_globs(config)
    if problems or config is None:
        raise ConfigError(located(source, problems))
    return config


def _unmatched_globs(config: Config) -> list[Problem]:
    """A policy glob written in the file that matches no file: tunerd would run without the
    policies meant (a path without wildcards that is missing is the policy loader's to say)."""
    problems = []
    base = Path(config.source_file).parent
    for index, pattern in enumerate(config.policies):
        full = pattern if Path(pattern).is_absolute() else str(base / pattern)
        if glob.has_magic(full) and not glob.glob(full):
            relative = "" if Path(pattern).is_absolute() else f" (relative to {base.resolve()})"
            problems.append(Problem(("policies", index), f"'{pattern}' matches no file{relative}"))
    return problems
