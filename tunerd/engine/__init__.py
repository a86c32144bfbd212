"""Engine control: vLLM's flags (``args``), supervise mode's process (``process``), the
restart saga (``saga``) and its guards (``guards``). systemd mode comes later."""
