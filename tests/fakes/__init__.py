"""Faithful stand-ins for what cannot run here (a GPU, NVML). Each notes where the real one was checked."""
