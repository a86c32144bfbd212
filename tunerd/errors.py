"""The error every part of tunerd raises for a person's bad input, whatever the part: the
command line reports it in one line and exits 2. A module of its own so the entry point can
catch it without loading the parts that raise it."""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """The input is wrong (a size, a duration, a model's shape…); the message says how."""
