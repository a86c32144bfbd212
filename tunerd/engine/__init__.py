"""Engine control: vLLM's flags (``args``) and supervise mode's process (``process``); the
restart saga and systemd mode come with the rest of the engine-control issue."""
