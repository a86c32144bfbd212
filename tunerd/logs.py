"""tunerd's own log: one JSON object a line on stdout (journald keeps it), or a console format
when a person runs it in a terminal. Built on structlog.

Every event is ``event`` plus its fields (``engine``, ``policy``, ``gpu``… where they apply),
a ``level`` and a UTC ``timestamp``. Secrets never appear: the value of any of tunerd's
secret-holding variables (``TUNERD_*`` ending in ``_URL``, ``_SECRET``, ``_TOKEN``, ``_KEY``,
``_PASSWORD`` or ``_WEBHOOK`` — where the config's ``url_env``/``secret_env`` point; webhook URLs
carry their tokens) is replaced by ``[redacted]`` wherever it shows up in an event. Other
variables (an engine's ``HF_TOKEN``) are not tunerd's and are never logged by it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

__all__ = ["configure", "redact", "say", "secret_values"]

_SECRET_SUFFIXES = ("_URL", "_SECRET", "_TOKEN", "_KEY", "_PASSWORD", "_WEBHOOK")
REDACTED = "[redacted]"


def secret_values(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The values to keep out of the log: tunerd's secret-holding variables (8+ characters, so
    a stray short value never blanks ordinary words)."""
    return tuple(
        sorted(
            {
                value
                for key, value in environ.items()
                if key.upper().endswith(_SECRET_SUFFIXES)
                and key.upper().startswith("TUNERD_")
                and len(value) >= 8
            },
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


def _redactor(secrets: tuple[str, ...]) -> Any:
    def processor(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        return {key: redact(value, secrets) for key, value in event.items()}

    return processor


def configure(
    stream: TextIO | None = None, *, console: bool | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """JSON lines on ``stream`` (stdout), or the console format on a terminal (``console``
    forces either); colour only when the terminal allows and ``NO_COLOR`` is unset."""
    out = stream or sys.stdout
    env = os.environ if environ is None else environ
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
            _redactor(secret_values(env)),
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
