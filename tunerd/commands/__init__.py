"""One module per ``tunerd`` subcommand: ``register(subparsers)`` adds its parser (a handler
in it does the work).

:data:`COMMANDS` names each top-level command, the module that registers it and its one-line
help. The entry point (:mod:`tunerd.cli`) imports only the module of the command asked for —
``tunerd status`` in a watch loop must start in a fraction of a second, not load the planner,
the policy schema and the daemon — and lists the others from this table.
"""

from __future__ import annotations

__all__ = ["COMMANDS", "summary"]

#: command → (module under tunerd.commands, one-line help), in the order ``--help`` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan", "plan GPU memory for a model, precision and workload; recommend vLLM flags"),
    "advise": ("advise", "right-size an engine's flags from what it served and what the box showed"),
    "inspect": ("inspect", "show what tunerd reads: a /metrics page, an engine log, the GPUs"),
    "policy": ("policy", "validate policy files, or run their tests"),
    "sim": ("sim", "the simulated GPU and vLLM engine, and a load generator"),
    "history": ("history", "recorded actions with their evidence (works while the daemon is down)"),
    "incident": ("incident", "post-mortems of every crash and action: what filled the GPU, what tunerd did"),
    "record": (
        "incident",
        "write a recording (signals, ticks, decisions): an incident's, or the daemon's next or last D",
    ),
    "replay": ("incident", "run policies over a recording: what they would have decided, beside what was"),
    "run": ("run", "watch the engines and tune them under the policies"),
    "gate": ("gate", "the KV-aware admission proxy in front of the engines (its own service)"),
    "status": ("status", "what the running daemon sees and did: GPUs, engines, bills, policies, guards"),
    "config": ("config", "validate the daemon's config"),
    "notify": ("notify", "the chat sinks: send a test alert"),
    "pin": ("pin", "freeze an engine's settings: no policy changes them until `tunerd resume`"),
    "resume": ("pin", "let tunerd tune an engine again (clears pin, hold and pause)"),
    "rollback": ("pin", "undo an engine's last settings change (the running tunerd restarts it)"),
    "demo": ("demo", "the simulator, the daemon and load: watch tunerd save a 24 GiB box"),
}


def summary(command: str) -> str:
    """A command's one-line help (its module registers it with this)."""
    return COMMANDS[command][1]
