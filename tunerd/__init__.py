"""tunerd: keep a vLLM inference box inside its GPU memory."""

__version__ = "0.1.0.dev0"
