"""The VRAM planner: model shapes, GPU profiles, the four bills and vLLM's KV pool. Pure.

``shapes`` reads model shapes, ``gpus`` knows the cards, ``bills`` is the one memory model
(also used by the simulator and the daemon), ``recommend`` decides, ``report`` renders.
"""
