"""Free memory on the device a pool is about to be allocated on."""
from __future__ import annotations

import os
from typing import Optional

import torch


def available_bytes(device: torch.device) -> Optional[int]:
    """Bytes free for a new allocation on ``device``; None where the backend cannot say.

    cuda: ``torch.cuda.mem_get_info``; cpu: MemAvailable from /proc/meminfo, else the
    available physical pages from ``os.sysconf``.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return _host_available_bytes()
    return None


def _host_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
