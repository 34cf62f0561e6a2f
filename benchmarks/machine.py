"""What the benchmark scripts print next to their figures: the machine they ran on."""

import platform


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
