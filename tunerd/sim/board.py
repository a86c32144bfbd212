"""One simulated GPU shared by several simulated engines (``tunerd sim serve --sim-gpu-share
FILE``): each engine posts what it holds on the card to FILE and reads what the others hold,
so a second engine's start-up check, its OOMs and ``/sim/gpu`` see the first one — as two
vLLM processes on one real card see each other through the driver.

FILE is a small JSON object ``{"PID": bytes}`` behind an ``flock``ed ``FILE.lock``; an entry
whose process is gone is dropped by the next reader, so a killed engine frees its memory as the
driver would.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

__all__ = ["GpuBoard"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class GpuBoard:
    def __init__(self, path: str | os.PathLike[str], pid: int) -> None:
        self.path = Path(path)
        self.pid = pid

    def exchange(self, mine: int) -> dict[int, int]:
        """Post ``mine`` (bytes this engine holds); what every other live engine holds."""
        with self._locked():
            held = {pid: size for pid, size in self._read().items() if pid != self.pid and _alive(pid)}
            self._write({**held, self.pid: mine} if mine else held)
        return held

    def leave(self) -> None:
        with contextlib.suppress(OSError), self._locked():
            self._write({pid: size for pid, size in self._read().items() if pid != self.pid})

    @contextlib.contextmanager
    def _locked(self):  # type: ignore[no-untyped-def]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[int, int]:
        try:
            return {int(pid): int(size) for pid, size in json.loads(self.path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _write(self, held: dict[int, int]) -> None:
        temporary = self.path.with_name(f".{self.path.name}.{self.pid}")
        temporary.write_text(json.dumps({str(pid): size for pid, size in sorted(held.items())}))
        temporary.replace(self.path)
