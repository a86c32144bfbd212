"""Engine control: vLLM's flags (``args``), and — with the engine-control issue — the restart
saga, supervise and systemd modes."""
