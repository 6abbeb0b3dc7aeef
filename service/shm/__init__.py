"""Tensors passed by reference to shared memory: the registry of POSIX and CUDA IPC regions
(`registry`), opening another process's CUDA memory (`cuda_ipc`) and ``POST /prefill``
through registered regions (`prefill`)."""
