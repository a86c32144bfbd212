"""Where tunerd's files are by default: the config, the state, the run directory — and how
tunerd creates its own files there: private to its user (folders 0700, files 0600) whatever
the umask or the unit's ``StateDirectoryMode``, because the state holds history and alert
texts. A module the command line can import without loading the config's schema."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_STATE_DIR",
    "RUN_DIR",
    "open_private",
    "private_dir",
    "private_fd",
]

DEFAULT_CONFIG = "/etc/tunerd/tunerd.yaml"
DEFAULT_STATE_DIR = "/var/lib/tunerd"
RUN_DIR = Path("/run/tunerd")  # the service's runtime directory: the status socket's home

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder: the folders missing on the way are created 0700 (exactly: the
    umask cannot widen or narrow them); a folder that was already there — the operator's
    ``/var/lib``, a home, a state folder made by hand or by systemd — keeps its mode."""
    path = Path(path)
    missing = []
    here = path
    while not here.exists():  # a folder we may not look into raises PermissionError
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs, left as it is
        os.chmod(folder, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    return path


def private_fd(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open(path, flags)``, creating the file 0600 (exactly) when it is missing; a file
    that exists keeps its mode. Its folder must exist (:func:`private_dir`)."""
    flags &= ~(os.O_CREAT | os.O_EXCL)
    for _ in range(3):
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except FileExistsError:
            try:
                return os.open(path, flags | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # removed between the two opens: create it after all
        try:
            os.fchmod(fd, FILE_MODE)  # the umask took bits away from 0600: put them back
        except BaseException:
            os.close(fd)
            raise
        return fd
    return os.open(path, flags | os.O_CLOEXEC)  # it kept vanishing: say why with its error


def open_private(path: str | os.PathLike[str], mode: str = "a", **options: Any) -> IO[Any]:
    """``open(path, mode, …)`` with the file created 0600 when missing (:func:`private_fd`):
    ``"a"``/``"ab"`` for the logs and the dead-letter file, ``"wb"`` for a copy."""
    return open(path, mode, opener=private_fd, **options)
