"""What tunerd reads: GPU memory, vLLM's /metrics and the engine's log. The I/O edge.

Each source splits fetching from parsing: the parsers (``smi.parse_*``, ``vllm_metrics.parse``,
and for the engine's log :func:`tunerd.diagnosis.diagnose`) are pure functions over text,
tested on recorded real output; the fetchers do the I/O with timeouts and typed errors.
"""
