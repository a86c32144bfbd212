"""systemd's notify protocol (sd_notify(3)), the few lines tunerd needs, without libsystemd.

A datagram of newline-separated ``KEY=VALUE`` to the unix socket in ``$NOTIFY_SOCKET`` (a
leading ``@`` names an abstract socket: a NUL byte instead). Outside systemd, or with an
address this does not speak (``vsock:``), every call does nothing. What tunerd sends:

- ``READY=1`` once its sources answer and the engines are reconciled; ``STATUS=`` a one-line
  summary (``systemctl status`` shows it);
- ``WATCHDOG=1`` from the GPU sampling loop, at half of ``$WATCHDOG_USEC`` (``WatchdogSec=``),
  so a wedged sampler is restarted by systemd; honoured only when ``$WATCHDOG_PID`` is unset or
  this process. :attr:`Notifier.hold` may withhold it: the daemon's says why while a job of its
  loop is stalled (:meth:`tunerd.scheduler.Jobs.stalled`), so a frozen loop behind a healthy
  sampler is restarted too;
- ``RELOADING=1`` with ``MONOTONIC_USEC=`` before a reload, ``READY=1`` after;
- ``STOPPING=1`` when it begins to stop.

Format and semantics from systemd's man pages (sd_notify(3), sd_watchdog_enabled(3)) and its
self-contained example (reference/integrations-facts.md §2.1).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if address.startswith("/"):
            self.address = address
        elif address.startswith("@"):
            self.address = "\0" + address[1:]
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        #: seconds between ``WATCHDOG=1`` pings (half of systemd's timeout), or None: no watchdog
        self.watchdog_interval = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        #: asked before each ``WATCHDOG=1``: a reason to withhold it (the process is not well), or None
        self.hold: Callable[[], str | None] | None = None
        self.withheld: str | None = None  # why the last ping was withheld, None when it was sent
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """One datagram; False if not under systemd or the socket refused it (never raises:
        telling systemd must not take tunerd down). Never waits: a receiver whose queue is
        full (a stuck manager, a test that does not read) loses the message instead of
        freezing the loop that sent it."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._socket is None:
                kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                self._socket = socket.socket(socket.AF_UNIX, kind)
            self._socket.sendto(message, self.address)
        except OSError:
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        return self.send(STATUS=text.replace("\n", " "))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``, unless :attr:`hold` gives a reason not to (a ``hold`` that raises
        does not: a broken check must not get a working tunerd restarted over and over)."""
        if self.watchdog_interval is None:
            return False
        try:
            self.withheld = self.hold() if self.hold is not None else None
        except Exception:
            self.withheld = None
        return self.withheld is None and self.send(WATCHDOG=1)

    def reloading(self) -> bool:
        return self.send(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)

    def stopping(self) -> bool:
        return self.send(STOPPING=1)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
