"""Memory a device can still give, and the one refusal every large allocation makes before it happens.

On the host that is what the kernel would hand out without swapping: Linux's MemAvailable (free
pages plus the page cache and reclaimable slab it would drop), not MemFree, which leaves the page
cache out and on a busy machine is half or less of it. Where /proc/meminfo is absent or has no
MemAvailable (kernels before 3.14, other systems) it falls back to the free pages sysconf reports.
"""

from __future__ import annotations

import os

import torch

from ..errors import AllocMoeError

MEMINFO = "/proc/meminfo"


def meminfo_available_bytes(path: str | os.PathLike = MEMINFO) -> int | None:
    """MemAvailable from a /proc/meminfo-style file, in bytes; None where the file or line is missing
    or unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as lines:
            for line in lines:
                name, _, rest = line.partition(":")
                if name.strip() == "MemAvailable":
                    value, *unit = rest.split()
                    scale = {"kb": 1024, "mb": 2**20, "gb": 2**30, "b": 1}.get(unit[0].lower(), 1) if unit else 1
                    return int(value) * scale
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes(device: torch.device, meminfo: str | os.PathLike = MEMINFO) -> int:
    """Memory `device` can still give: the CUDA allocator's free memory, or the host's MemAvailable
    (`meminfo`), falling back to the free pages sysconf reports where that file has none."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = meminfo_available_bytes(meminfo)
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")



def check_free_memory(need: int, device: torch.device, what: str, fix: str, detail: str = "",
                      share: float = 0.8, meminfo: str | os.PathLike | None = None) -> None:
    """Refuse, before allocating, `need` bytes that would take more than `share` of the memory
    `device` can still give: "<what> needs N GiB<detail>, A GiB is available; <fix>"."""
    available = available_memory_bytes(device, meminfo if meminfo is not None else MEMINFO)
    if need > share * available:
        raise AllocMoeError(f"{what} needs {need / 2**30:.1f} GiB{detail}, {available / 2**30:.1f} GiB is "
                            f"available; {fix}")
