"""Where tunerd's files are by default: the config, the state, the run directory. A module of
constants only, so the command line can name them without loading the config's schema."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_CONFIG", "DEFAULT_STATE_DIR", "RUN_DIR"]

DEFAULT_CONFIG = "/etc/tunerd/tunerd.yaml"
DEFAULT_STATE_DIR = "/var/lib/tunerd"
RUN_DIR = Path("/run/tunerd")  # the service's runtime directory: the status socket's home
