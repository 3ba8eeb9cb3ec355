"""What machine this is: CPU, DRAM, GPU, and the memory this process holds (Linux /proc)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def rss_bytes() -> int:
    """Resident set size of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM), resettable with :func:`reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs). False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def dram_total_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(nvme_paths: list[Path] = ()) -> dict:
    """A JSON-able summary of the hardware, stored with each profiled run."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "dram_bytes": dram_total_bytes(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0,
        "filesystems": {},
    }
    try:
        from zinf.storage.fsinfo import filesystem_of

        for p in nvme_paths:
            fs = filesystem_of(p)
            info["filesystems"][str(p)] = {"fstype": fs.fstype, "mount_point": str(fs.mount_point), "options": list(fs.options)}
    except Exception as exc:  # a missing /proc/mounts must not stop training
        info["filesystems_error"] = str(exc)
    return info
