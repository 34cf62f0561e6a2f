"""Free memory on a device, and the one refusal every large allocation makes before it happens."""

from __future__ import annotations

import os

import torch

from ..errors import AllocMoeError


def free_memory_bytes(device: torch.device) -> int:
    """Memory still free on `device`: the CUDA allocator's view, or the host's available pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_free_memory(need: int, device: torch.device, what: str, fix: str, detail: str = "",
                      share: float = 0.8) -> None:
    """Refuse, before allocating, `need` bytes that would take more than `share` of `device`'s free
    memory: "<what> needs N GiB<detail>, F GiB is free; <fix>"."""
    free = free_memory_bytes(device)
    if need > share * free:
        raise AllocMoeError(f"{what} needs {need / 2**30:.1f} GiB{detail}, {free / 2**30:.1f} GiB is free; {fix}")
