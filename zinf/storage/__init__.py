"""Storage layer: aligned host buffers, block I/O backends, shard files and the NVMe swap store.

See :mod:`zinf.storage.shardfile` for the on-disk format and :mod:`zinf.storage.nvme` for the
layout of a run's swap directory.
"""

from zinf.storage.aligned import ALIGN, BufferPool, StagingPool, aligned_empty, is_aligned, round_down, round_up
from zinf.storage.fsinfo import FsInfo, filesystem_of, o_direct_supported, probe_o_direct
from zinf.storage.io import (
    IoBackend,
    ShortTransferError,
    ThreadPoolBackend,
    read_full,
    write_full,
)
from zinf.storage.nvme import NvmeStore
from zinf.storage.shardfile import (
    HEADER_BYTES,
    MAGIC,
    ShardHeader,
    copy_tensor_file,
    crc32_combine,
    fsync_dir,
    read_header,
    read_tensor_file,
    write_tensor_file,
)

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "MAGIC",
    "FsInfo",
    "IoBackend",
    "NvmeStore",
    "ShardHeader",
    "ShortTransferError",
    "StagingPool",
    "BufferPool",
    "ThreadPoolBackend",
    "aligned_empty",
    "copy_tensor_file",
    "crc32_combine",
    "filesystem_of",
    "fsync_dir",
    "is_aligned",
    "o_direct_supported",
    "probe_o_direct",
    "read_full",
    "read_header",
    "read_tensor_file",
    "round_down",
    "round_up",
    "write_full",
    "write_tensor_file",
]
