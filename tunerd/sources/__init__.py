"""What tunerd reads: GPU memory, vLLM's /metrics and the engine's log. The I/O edge.

Each source splits fetching from parsing: the parsers (``smi.parse_*``,
``vllm_metrics.parse``, ``engine_log.diagnose``) are pure functions over text, tested on
recorded real output; the fetchers do the I/O with timeouts and typed errors.
"""
