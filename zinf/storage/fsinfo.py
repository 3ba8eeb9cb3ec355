"""What filesystem a path lives on, and whether it accepts ``O_DIRECT``.

Used by the NVMe store at open (to fall back to buffered I/O), by ``zinf doctor``, and by the
profiler's hardware record.
"""

from __future__ import annotations

import errno
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from zinf.storage.aligned import ALIGN, aligned_empty

# Errors with which a filesystem says "no O_DIRECT here" (tmpfs before Linux 6.6 and ramfs give
# EINVAL at open; some FUSE filesystems give EOPNOTSUPP).
_O_DIRECT_REFUSED_ERRNOS = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS)


@dataclass(frozen=True)
class FsInfo:
    """One line of /proc/mounts: the mount that holds a path."""

    mount_point: str
    fstype: str  # e.g. "ext4", "xfs", "tmpfs"
    device: str  # e.g. "/dev/nvme0n1p1"
    options: list[str] = field(default_factory=list)  # e.g. ["rw", "relatime"]


def _unescape_mount_field(text: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in paths as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        text = text.replace(code, chr(int(code[1:], 8)))
    return text


def _existing_ancestor(path: Path) -> Path:
    """``path`` resolved, or its nearest existing parent when it does not exist yet."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.resolve()


def filesystem_of(path: str | os.PathLike) -> FsInfo:
    """The mount holding ``path`` (the longest mount point that contains it; the last mounted
    wins where several are stacked on one point). Falls back to an "unknown" entry where
    /proc/mounts cannot be read."""
    target = str(_existing_ancestor(Path(path)))
    best: FsInfo | None = None
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return FsInfo(mount_point="/", fstype="unknown", device="unknown", options=[])
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        device, mount_point, fstype, options = (_unescape_mount_field(x) for x in fields[:4])
        prefix = mount_point.rstrip("/") + "/"
        if target != mount_point and not target.startswith(prefix):
            continue
        if best is None or len(mount_point) >= len(best.mount_point):
            best = FsInfo(mount_point, fstype, device, options.split(","))
    return best or FsInfo(mount_point="/", fstype="unknown", device="unknown", options=[])


def probe_o_direct(directory: str | os.PathLike) -> bool:
    """Write one aligned block with ``O_DIRECT`` to a scratch file in ``directory``.

    Returns False when the filesystem refuses ``O_DIRECT``; other errors (the directory is
    missing, read-only or full) propagate as ``OSError``. The scratch file is always removed.
    """
    if not O_DIRECT:
        return False
    probe = Path(directory) / f".zinf-odirect-probe-{uuid.uuid4().hex[:12]}"
    block = aligned_empty(ALIGN)
    block.fill_(0x5A)
    fd = -1
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT | os.O_CLOEXEC, 0o600)
        os.pwrite(fd, memoryview(block.numpy()), 0)
        return True
    except OSError as e:
        if e.errno in _O_DIRECT_REFUSED_ERRNOS:
            return False
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            probe.unlink()
        except FileNotFoundError:
            pass


def o_direct_supported(path: str | os.PathLike) -> bool:
    """Whether the filesystem holding ``path`` accepts ``O_DIRECT`` (probed with a real write in
    ``path``, or in its parent when ``path`` is a file)."""
    path = Path(path)
    return probe_o_direct(path if path.is_dir() else path.parent)
