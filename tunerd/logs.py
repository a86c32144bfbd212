"""tunerd's own log: one JSON object a line on stdout (journald keeps it), or a console format
when a person runs it in a terminal. Built on structlog.

Every event is ``event`` plus its fields (``engine``, ``policy``, ``gpu``… where they apply),
a ``level`` and a UTC ``timestamp``. Secrets never appear: the value of any of tunerd's
secret-holding variables is replaced by ``[redacted]`` wherever it shows up in an event —
every variable the config names as a secret (a sink's ``url_env``/``secret_env``, whatever its
name: ``secret_names``, given to :func:`configure` and, after a reload, to :func:`redact_also`;
webhook URLs carry their tokens) and every ``TUNERD_*`` variable ending in ``_URL``,
``_SECRET``, ``_TOKEN``, ``_KEY``, ``_PASSWORD`` or ``_WEBHOOK``. Other variables (an engine's
``HF_TOKEN``) are not tunerd's and are never logged by it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping, MutableMapping
from typing import Any, TextIO

import structlog

__all__ = ["configure", "redact", "redact_also", "say", "secret_values"]

_SECRET_SUFFIXES = ("_URL", "_SECRET", "_TOKEN", "_KEY", "_PASSWORD", "_WEBHOOK")
REDACTED = "[redacted]"
#: what the log's redactor replaces now (longest first); configure() and redact_also() set it
_secrets: tuple[str, ...] = ()


def _is_secret(key: str, names: Collection[str]) -> bool:
    upper = key.upper()
    return key in names or (upper.startswith("TUNERD_") and upper.endswith(_SECRET_SUFFIXES))


def secret_values(environ: Mapping[str, str], secret_names: Collection[str] = ()) -> tuple[str, ...]:
    """The values to keep out of the log: tunerd's secret-holding variables and those named in
    ``secret_names`` (8+ characters, so a stray short value never blanks ordinary words)."""
    names = frozenset(secret_names)
    return tuple(
        sorted(
            {value for key, value in environ.items() if _is_secret(key, names) and len(value) >= 8},
            key=len,
            reverse=True,
        )
    )


def redact(value: Any, secrets: tuple[str, ...]) -> Any:
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, Mapping):
        return {key: redact(item, secrets) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item, secrets) for item in value]
    return value


def _redactor(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    secrets = _secrets  # read once: a reload may replace it meanwhile
    return {key: redact(value, secrets) for key, value in event.items()}


def redact_also(secret_names: Collection[str], environ: Mapping[str, str] | None = None) -> None:
    """Redact the values of ``secret_names`` too from now on (a reloaded config named new
    ones); what was redacted stays redacted."""
    global _secrets  # noqa: PLW0603 - the one redactor every logger of the process shares
    found = secret_values(os.environ if environ is None else environ, secret_names)
    _secrets = tuple(sorted(set(_secrets) | set(found), key=len, reverse=True))


def configure(
    stream: TextIO | None = None,
    *,
    console: bool | None = None,
    environ: Mapping[str, str] | None = None,
    secret_names: Collection[str] = (),
) -> None:
    """JSON lines on ``stream`` (stdout), or the console format on a terminal (``console``
    forces either); colour only when the terminal allows and ``NO_COLOR`` is unset. The values
    of ``secret_names`` (the variables the config names as secrets) and of tunerd's own
    ``TUNERD_*`` secrets in ``environ`` are redacted."""
    global _secrets  # noqa: PLW0603 - see redact_also
    out = stream or sys.stdout
    env = os.environ if environ is None else environ
    _secrets = secret_values(env, secret_names)
    if console is None:
        console = out.isatty()
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=not env.get("NO_COLOR"))
        if console
        else structlog.processors.JSONRenderer(default=str)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redactor,
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


def say(event: str, **fields: Any) -> None:
    """One event: a warning when its name says something failed, else info; an engine's log
    line (``engine_log``) at the level the engine logged it."""
    logger = structlog.get_logger("tunerd")
    level = fields.get("engine_level")
    if event == "engine_log" and level in ("debug", "info", "warning", "error", "critical"):
        getattr(logger, level)(event, **fields)
        return
    failed = event.endswith(("_failed", "_unavailable", "_problem")) or event in ("engine_crash", "alert")
    (logger.warning if failed else logger.info)(event, **fields)
