"""One module per ``tunerd`` subcommand: ``register(subparsers)`` and ``run(args)``."""
