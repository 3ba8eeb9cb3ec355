"""One file per tensor state: a 4096-byte header, then the payload padded to a multiple of 4096.

The layout is simple enough to inspect by hand (``head -c 4096 FILE`` prints the header)::

    offset 0     ZINFSHD1\\n{"version": 1, "key": "...", "dtype": "bfloat16", "shape": [..],
                 "nbytes": N, "crc32": C}\\n  then NUL bytes up to 4096
    offset 4096  the tensor's bytes in row-major order (N bytes), then zeros up to a multiple
                 of 4096, so that every transfer is block-aligned and ``O_DIRECT`` works

``crc32`` is ``zlib.crc32`` of the N payload bytes (not the padding), computed with ISA-L's
implementation of the same function where the ``isal`` package is installed (about 50 GB/s
against zlib's 4–6 GB/s on one core here; the values are identical). For memory the kernel
can use directly (``_DirectPlan``) the caller checksums the whole payload while the backend
moves all but its first block, then moves the header with that first block in one call, so no
transfer waits on a separate header write and a file up to one block is one system call. For
memory that goes through staging windows, pieces are checksummed on the I/O worker threads as
they land and combined with :func:`crc32_combine`.

Files are only ever replaced, never modified in place: a writer writes a temporary file next to
the target, flushes it with ``fdatasync`` and renames it over the target. A reader (or a hard
link) that has the old file open keeps seeing the old bytes, and a crash leaves either the old
or the new version at the path, never a mix.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import threading
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from zinf.errors import CorruptShardError, StorageError, ZinfError
from zinf.storage.aligned import ALIGN, aligned_empty, is_aligned, round_down, round_up
from zinf.storage.fsinfo import O_DIRECT
from zinf.storage.io import IoBackend, ShortTransferError, read_full, readv_full, write_full, writev_full
from zinf.spans import span

try:  # the same CRC-32 as zlib's, ~10x faster; it releases the GIL like zlib does
    from isal.isal_zlib import crc32 as payload_crc32
except ImportError:  # pragma: no cover - isal is a declared dependency; keep working without it
    payload_crc32 = zlib.crc32

MAGIC = b"ZINFSHD1"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
# The unit of checksumming: each piece of this size is checksummed by the worker thread that
# completed it. A power of two keeps crc32_combine at one matrix product per piece.
CRC_CHUNK_BYTES = 4 << 20
# The first call of a direct transfer (header + first payload bytes, on the caller's thread)
# moves up to this much, or the backend's block size if larger: handing a 1 MiB transfer to a
# worker thread and waiting for it costs more than the transfer (measured: benchmarks/RESULTS.md).
ONE_CALL_MAX_BYTES = 1 << 20
# Bounce buffer used when the caller gives no staging buffer and one is needed.
DEFAULT_WINDOW_BYTES = 16 << 20
COPY_CHUNK_BYTES = 8 << 20

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}


# --------------------------------------------------------------------------------------------
# Header


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _corrupt(path: Path, key: str | None, why: str) -> CorruptShardError:
    what = f"shard file {path}" + (f" (key {key!r})" if key is not None else "")
    return CorruptShardError(
        f"{what} is corrupt: {why}; restore the checkpoint or swap directory it came from"
    )


def _checksum_mismatch(path: Path, key: str | None, header: "ShardHeader", crc: int) -> CorruptShardError:
    return _corrupt(
        path,
        key if key is not None else header.key,
        f"checksum mismatch (header crc32 {header.crc32:#010x}, payload {crc:#010x})",
    )


# The header's last field, as json.dumps writes it after the others: _header_json_prefix checks
# that it does, and ShardHeader.decode finds the CRC's digits after it (JSON escapes a key's
# quotes, so these bytes can only be the field itself)
_CRC_FIELD = b', "crc32": '


@functools.lru_cache(maxsize=1 << 16)
def _header_json_prefix(version: int, key: str, dtype: torch.dtype, shape: tuple, nbytes: int) -> bytes:
    """The header up to the CRC's digits. A shard is rewritten every step with only its CRC
    changed, so this part is built once per shard (json.dumps costs ~10 us a write)."""
    body = {"version": version, "key": key, "dtype": _dtype_name(dtype), "shape": list(shape),
            "nbytes": nbytes, "crc32": 0}
    text = json.dumps(body, ensure_ascii=True)
    assert text.endswith(_CRC_FIELD.decode("ascii") + "0}")  # (what ShardHeader.decode looks for)
    return MAGIC + b"\n" + text[: -len("0}")].encode("ascii")


# header bytes up to the CRC's digits -> (key, dtype, shape, nbytes, version), each already checked
# by a full decode: a shard's file is read with the same header every step but its CRC (a JSON
# parse and its checks cost ~7 us a read on a request thread, holding the GIL)
_checked_prefixes: dict[bytes, tuple] = {}
_CHECKED_PREFIXES_MAX = 1 << 16


@dataclass(frozen=True)
class ShardHeader:
    """The header of a shard file. ``nbytes`` is the payload length without padding."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc32: int
    version: int = FORMAT_VERSION

    @property
    def file_bytes(self) -> int:
        """The exact length of a complete file with this header."""
        return HEADER_BYTES + round_up(self.nbytes)

    def encode(self) -> bytes:
        """The 4096 bytes written at offset 0."""
        raw = _header_json_prefix(self.version, self.key, self.dtype, self.shape, self.nbytes)
        raw += b"%d}\n" % self.crc32
        if len(raw) > HEADER_BYTES:
            raise ValueError(
                f"shard header for key {self.key[:80]!r} needs {len(raw)} bytes, more than the "
                f"{HEADER_BYTES} a header holds; use a shorter key"
            )
        return raw.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes, path: Path, expected_key: str | None = None) -> ShardHeader:
        """Parse and check a header; anything malformed raises :class:`CorruptShardError`."""
        if len(raw) < HEADER_BYTES:
            raise _corrupt(
                path, expected_key, f"truncated header ({len(raw)} of {HEADER_BYTES} bytes)"
            )
        if raw[: len(MAGIC)] != MAGIC:
            raise _corrupt(
                path, expected_key, f"bad magic {raw[: len(MAGIC)]!r}, expected {MAGIC!r}"
            )
        end = raw.find(b"\0", len(MAGIC) + 1)
        body = raw[len(MAGIC) + 1 : end if end >= 0 else len(raw)]
        # a header whose every byte before the CRC's digits a full decode has checked already
        at = body.rfind(_CRC_FIELD)
        prefix, digits = body[:at], body[at + len(_CRC_FIELD) : -2]
        cacheable = at >= 0 and body.endswith(b"}\n") and digits.isdigit()
        checked = _checked_prefixes.get(prefix) if cacheable else None
        if checked is not None:
            key, dtype, shape, nbytes, version = checked
            header = cls(key=key, dtype=dtype, shape=shape, nbytes=nbytes, crc32=int(digits), version=version)
        else:
            header = cls._parse(body, path, expected_key)
            if cacheable:
                if len(_checked_prefixes) >= _CHECKED_PREFIXES_MAX:
                    _checked_prefixes.clear()
                _checked_prefixes[prefix] = (header.key, header.dtype, header.shape, header.nbytes, header.version)
        if expected_key is not None and header.key != expected_key:
            raise _corrupt(path, expected_key, f"it holds key {header.key!r}")
        return header

    @classmethod
    def _parse(cls, body: bytes, path: Path, expected_key: str | None) -> ShardHeader:
        """The header's JSON ``body``, parsed and checked (but for its key: :meth:`decode`)."""
        try:
            fields = json.loads(body.decode("ascii"))
            header = cls(
                key=str(fields["key"]),
                dtype=_dtype_from_name(fields["dtype"]),
                shape=tuple(int(d) for d in fields["shape"]),
                nbytes=int(fields["nbytes"]),
                crc32=int(fields["crc32"]),
                version=int(fields["version"]),
            )
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise _corrupt(
                path, expected_key, f"unreadable header ({type(e).__name__}: {e})"
            ) from e
        key = expected_key if expected_key is not None else header.key
        if header.version > FORMAT_VERSION:
            raise _corrupt(
                path,
                key,
                f"format version {header.version} is newer than this zinf reads ({FORMAT_VERSION})",
            )
        if header.dtype is None:
            raise _corrupt(path, key, f"unknown dtype {fields['dtype']!r} in header")
        numel = 1
        for d in header.shape:
            numel *= d
        itemsize = header.dtype.itemsize
        if min(header.shape, default=0) < 0 or numel * itemsize != header.nbytes:
            raise _corrupt(
                path,
                key,
                f"header says {header.nbytes} bytes for {header.dtype} of shape "
                f"{list(header.shape)}",
            )
        return header


def _read_header_fd(fd: int, path: Path, expected_key: str | None) -> ShardHeader:
    """Read and check the header through ``fd`` (which may be ``O_DIRECT``), and check that the
    file has exactly the length the header implies."""
    size_bytes = os.fstat(fd).st_size
    if size_bytes < HEADER_BYTES:
        raise _corrupt(
            path, expected_key, f"truncated: {size_bytes} bytes, shorter than the header"
        )
    block = aligned_empty(HEADER_BYTES)
    view = memoryview(block.numpy())
    read_full(fd, view, 0)
    header = ShardHeader.decode(bytes(view), path, expected_key)
    if size_bytes != header.file_bytes:
        raise _corrupt(
            path,
            expected_key,
            f"truncated or overlong: {size_bytes} bytes, the header implies {header.file_bytes}",
        )
    return header


def read_header(path: str | os.PathLike) -> ShardHeader:
    """The header of the shard file at ``path`` (checked against the file length)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _storage_error("open", path, e) from e
    try:
        return _read_header_fd(fd, path, None)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# CRC-32 of a payload assembled from pieces


def _gf2_apply(matrix: list[int], vector: int) -> int:
    """Multiply a 32x32 GF(2) matrix (``matrix[i]`` is the image of bit i) by a vector."""
    out = 0
    i = 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.cache
def _zero_append_operators() -> list[list[int]]:
    """``ops[k]`` maps the CRC of X to the CRC of X followed by 2**k zero bytes, minus the CRC
    of those zeros alone. CRC-32 is affine, so that map is linear and a 32x32 matrix."""
    base = zlib.crc32(b"\0", 0)
    ops = [[zlib.crc32(b"\0", 1 << i) ^ base for i in range(32)]]
    for _ in range(1, 48):  # up to 2**47 bytes
        prev = ops[-1]
        ops.append([_gf2_apply(prev, prev[i]) for i in range(32)])
    return ops


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)``, ``len(b)``."""
    ops = _zero_append_operators()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_apply(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


class _CrcParts:
    """CRCs of payload pieces, added from worker threads in any order, combined at the end."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, int, int]] = []  # (payload offset, length, crc)
        self._lock = threading.Lock()

    def add(self, offset_bytes: int, length_bytes: int, crc: int) -> None:
        with self._lock:
            self._parts.append((offset_bytes, length_bytes, crc))

    def combine(self, nbytes: int) -> int:
        crc = 0
        pos_bytes = 0
        for offset_bytes, length_bytes, part_crc in sorted(self._parts):
            # The pieces must tile the payload exactly, or the check would miss bytes.
            assert offset_bytes == pos_bytes, f"crc pieces leave a gap at {pos_bytes}"
            crc = crc32_combine(crc, part_crc, length_bytes)
            pos_bytes += length_bytes
        assert pos_bytes == nbytes, f"crc pieces cover {pos_bytes} of {nbytes} bytes"
        return crc


# --------------------------------------------------------------------------------------------
# Moving a payload between memory and a file, with the checksum computed on the way


class _Latch:
    """Counts outstanding pieces; remembers the first error. Waiting on this (rather than on the
    backend futures) also waits for the checksum callbacks, which run after a future is done."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None

    def add(self) -> None:
        with self._cond:
            self._pending += 1

    def done(self, error: BaseException | None = None) -> None:
        with self._cond:
            if error is not None and self.error is None:
                self.error = error
            self._pending -= 1
            if self._pending == 0:
                self._cond.notify_all()

    @property
    def pending(self) -> bool:
        return self._pending > 0

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def wait_and_raise(self) -> None:
        self.wait()
        if self.error is not None:
            raise self.error


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _memview(t: torch.Tensor) -> memoryview:
    """A memoryview over a 1-D uint8 CPU tensor, for the backend."""
    return memoryview(t.numpy())


class _Transfer:
    """One payload transfer (``op`` is "read" or "write") between ``data`` and ``fd``.

    ``data`` is a flat uint8 tensor holding the payload's ``nbytes`` (it may be longer: when it
    holds the padded length, the padding is moved too). How it goes depends on the memory:

    * buffered I/O: straight between ``data`` and the file (the padding is already zeros,
      from preallocation);
    * ``O_DIRECT`` with ``data`` aligned: the aligned prefix straight, the sub-block tail through
      a one-block bounce buffer (unless ``data`` holds the padded length);
    * ``O_DIRECT`` with ``data`` unaligned: through an aligned staging buffer, in windows of half
      its size so that the copy of one window overlaps the I/O of the other.
    """

    def __init__(self, backend: IoBackend, fd: int, op: str, *, checksum: bool) -> None:
        self.backend = backend
        self.fd = fd
        self.op = op
        self.checksum = checksum
        self.crcs = _CrcParts()
        self._latches: list[_Latch] = []

    def run(
        self, data: torch.Tensor, nbytes: int, *, o_direct: bool, staging: torch.Tensor | None
    ) -> int | None:
        """Move the payload; returns its CRC-32 (None when not checksumming)."""
        if not o_direct:
            direct_io_bytes = window_start = nbytes
        elif data.numel() >= round_up(nbytes) and is_aligned(data):
            direct_io_bytes, window_start = round_up(nbytes), nbytes
        elif is_aligned(data):
            direct_io_bytes = window_start = round_down(nbytes)
        else:
            direct_io_bytes = window_start = 0
        try:
            latch = self._new_latch()
            self._submit(
                data[:direct_io_bytes], HEADER_BYTES, 0, min(direct_io_bytes, nbytes), latch
            )
            if window_start < nbytes:
                if window_start > 0 or staging is None:
                    # Only a tail (or no staging given): a small buffer of our own suffices.
                    buffer = aligned_empty(
                        min(round_up(nbytes - window_start), DEFAULT_WINDOW_BYTES)
                    )
                else:
                    buffer = staging
                self._windows(data, window_start, nbytes, buffer)
        finally:
            # Never leave pieces in flight: the caller closes the fd and frees the buffers next.
            self._help_while_waiting()
            for latch in self._latches:
                latch.wait()
        for latch in self._latches:
            if latch.error is not None:
                raise latch.error
        return self.crcs.combine(nbytes) if self.checksum else None

    def _help_while_waiting(self, latches: list[_Latch] | None = None) -> None:
        """Run queued pieces (ours or another transfer's) on this thread while any of
        ``latches`` (default: all of this transfer's) is pending and the backend has work."""
        help_ = getattr(self.backend, "help", None)
        if help_ is None:
            return
        latches = self._latches if latches is None else latches
        while any(latch.pending for latch in latches) and help_():
            pass

    def _new_latch(self) -> _Latch:
        latch = _Latch()
        self._latches.append(latch)
        return latch

    def _submit(
        self,
        mem: torch.Tensor,
        file_offset: int,
        payload_offset: int,
        crc_bytes: int,
        latch: _Latch,
    ) -> None:
        """Submit ``mem`` (to or from ``file_offset``) in checksum-sized pieces; the first
        ``crc_bytes`` of it are payload bytes starting at ``payload_offset``."""
        view = _memview(mem)
        submit = self.backend.pread if self.op == "read" else self.backend.pwrite
        for start in range(0, len(view), CRC_CHUNK_BYTES):
            piece = view[start : start + CRC_CHUNK_BYTES]
            piece_crc_bytes = max(0, min(len(piece), crc_bytes - start))
            latch.add()
            try:
                future = submit(self.fd, piece, file_offset + start)
            except BaseException as e:
                latch.done(e)
                raise
            future.add_done_callback(
                functools.partial(
                    self._piece_done, latch, piece, payload_offset + start, piece_crc_bytes
                )
            )

    def _piece_done(
        self, latch: _Latch, piece: memoryview, payload_offset: int, crc_bytes: int, future
    ) -> None:
        # Runs on the worker thread that finished the piece; zlib.crc32 releases the GIL.
        error = future.exception()
        try:
            if error is None and self.checksum and crc_bytes > 0:
                self.crcs.add(payload_offset, crc_bytes, payload_crc32(piece[:crc_bytes]))
        except BaseException as e:
            error = e
        finally:
            latch.done(error)

    def _windows(self, data: torch.Tensor, start: int, nbytes: int, buffer: torch.Tensor) -> None:
        """Move payload bytes ``[start, nbytes)`` through ``buffer``, double-buffered."""
        if buffer.numel() >= 2 * ALIGN:
            window_bytes = round_down(buffer.numel() // 2)
            halves = [buffer[:window_bytes], buffer[window_bytes : 2 * window_bytes]]
        else:
            window_bytes = round_down(buffer.numel())
            halves = [buffer[:window_bytes]]
        pending: deque[tuple[_Latch, torch.Tensor, int, int]] = deque()
        for i, offset in enumerate(range(start, nbytes, window_bytes)):
            length = min(window_bytes, nbytes - offset)
            io_bytes = round_up(length)
            half = halves[i % len(halves)]
            if len(pending) == len(halves):
                self._finish_window(data, *pending.popleft())
            if self.op == "write":
                half[:length].copy_(data[offset : offset + length])
                half[length:io_bytes].zero_()
            latch = self._new_latch()
            self._submit(half[:io_bytes], HEADER_BYTES + offset, offset, length, latch)
            pending.append((latch, half, offset, length))
        while pending:
            self._finish_window(data, *pending.popleft())

    def _finish_window(
        self, data: torch.Tensor, latch: _Latch, half: torch.Tensor, offset: int, length: int
    ) -> None:
        self._help_while_waiting([latch])
        latch.wait_and_raise()
        if self.op == "read":
            data[offset : offset + length].copy_(half[:length])


# --------------------------------------------------------------------------------------------
# Writing and reading whole files


def _storage_error(action: str, path: Path, e: OSError) -> StorageError:
    """A one-line :class:`StorageError` for an ``OSError`` met while touching ``path``."""
    if e.errno in _NO_SPACE_ERRNOS:
        msg = (
            f"no space left on the device to {action} {path}; free space or point nvme_path "
            f"elsewhere"
        )
    elif e.errno in _READ_ONLY_ERRNOS:
        msg = (
            f"cannot {action} {path}: {e.strerror}; make the directory writable or point "
            f"nvme_path elsewhere"
        )
    elif e.errno == errno.ENOENT:
        msg = f"cannot {action} {path}: it does not exist"
    else:
        msg = f"cannot {action} {path}: {e.strerror or e}"
    err = StorageError(msg)
    err.errno = e.errno
    return err


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _tmp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")


def _preallocate(fd: int, length_bytes: int) -> None:
    """Reserve the file's blocks up front, so that a full disk fails before any payload moves."""
    if length_bytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, length_bytes)
    except OSError as e:
        if e.errno in _NO_SPACE_ERRNOS:
            raise
        os.ftruncate(fd, length_bytes)  # the filesystem cannot preallocate; a sparse file will do


def _write_header(fd: int, header: ShardHeader) -> None:
    write_full(fd, _header_block(header), 0)


def _check_staging(staging: torch.Tensor | None) -> None:
    if staging is None:
        return
    if not (
        staging.dtype == torch.uint8
        and staging.device.type == "cpu"
        and staging.dim() == 1
        and staging.is_contiguous()
        and is_aligned(staging)
        and staging.numel() >= ALIGN
    ):
        raise ValueError(
            "staging must be a 1-D contiguous uint8 CPU tensor of at least 4096 bytes starting at "
            "a 4096-aligned address (use zinf.storage.aligned_empty or a StagingPool buffer)"
        )


def needs_staging(tensor: torch.Tensor, *, o_direct: bool) -> bool:
    """Whether writing (or reading into) ``tensor`` goes through a staging copy: true for
    non-contiguous tensors, and for ``O_DIRECT`` on memory that is not 4096-aligned."""
    return not tensor.is_contiguous() or (
        o_direct and tensor.numel() > 0 and not is_aligned(tensor)
    )


class _DirectPlan:
    """How a payload moves straight between ``data`` and the file, header included.

    The caller's thread moves the header block together with the payload's first
    ``first_bytes`` in one vectored call; the backend moves the rest of the aligned payload,
    ``[first_bytes, prefix_bytes)``, in block-size pieces meanwhile. Under ``O_DIRECT`` a payload
    whose length is not a multiple of 4096 (and whose tensor holds no padding) ends in a one-block
    ``tail`` bounce buffer. Small files (up to one block) thus take a single system call, and no
    transfer waits on a separate header write.
    """

    def __init__(self, data: torch.Tensor, nbytes: int, block_bytes: int, *, o_direct: bool) -> None:
        if not o_direct:
            self.prefix_bytes = nbytes  # buffered: the file's padding is zeros already
        elif data.numel() >= round_up(nbytes):
            self.prefix_bytes = round_up(nbytes)  # the tensor holds the padding: move it too
        else:
            self.prefix_bytes = round_down(nbytes)
        self.nbytes = nbytes
        self.view = _memview(data[: self.prefix_bytes]) if self.prefix_bytes else memoryview(b"")
        self.tail = aligned_empty(ALIGN) if self.prefix_bytes < nbytes else None
        self.tail_view = memoryview(self.tail.numpy()) if self.tail is not None else None
        self.first_bytes = min(self.prefix_bytes, max(block_bytes, ONE_CALL_MAX_BYTES))
        self.tail_in_first_call = self.first_bytes == self.prefix_bytes

    @staticmethod
    def suits(data: torch.Tensor, *, o_direct: bool) -> bool:
        """Whether ``data`` can be moved without staging (always, without ``O_DIRECT``)."""
        return not o_direct or is_aligned(data)

    @property
    def single_call(self) -> bool:
        return self.first_bytes == self.prefix_bytes and self.tail_in_first_call

    def first_call(self, head: memoryview) -> list[memoryview]:
        bufs = [head]
        if self.first_bytes:
            bufs.append(self.view[: self.first_bytes])
        if self.tail_view is not None and self.tail_in_first_call:
            bufs.append(self.tail_view)
        return bufs

    def submit_rest(self, backend: IoBackend, fd: int, op: str) -> list:
        """Hand the rest of the payload to ``backend``; returns the futures."""
        submit = backend.pread if op == "read" else backend.pwrite
        futures = []
        if self.first_bytes < self.prefix_bytes:
            futures.append(submit(fd, self.view[self.first_bytes :], HEADER_BYTES + self.first_bytes))
        if self.tail_view is not None and not self.tail_in_first_call:
            futures.append(submit(fd, self.tail_view, HEADER_BYTES + self.prefix_bytes))
        return futures

    def fill_tail(self, data: torch.Tensor) -> None:
        """Writing: copy the payload's last partial block into the tail (zero padded)."""
        if self.tail is not None:
            length = self.nbytes - self.prefix_bytes
            self.tail.zero_()
            self.tail[:length].copy_(data[self.prefix_bytes : self.nbytes])

    def drain_tail(self, data: torch.Tensor) -> None:
        """Reading: copy the payload's last partial block out of the tail."""
        if self.tail is not None:
            length = self.nbytes - self.prefix_bytes
            data[self.prefix_bytes : self.nbytes].copy_(self.tail[:length])

    def crc(self) -> int:
        """CRC-32 of the payload bytes (aligned part, then the tail's payload bytes)."""
        aligned_bytes = min(self.prefix_bytes, self.nbytes)
        crc = payload_crc32(self.view[:aligned_bytes])
        if self.tail_view is not None:
            crc = payload_crc32(self.tail_view[: self.nbytes - self.prefix_bytes], crc)
        return crc


def _wait_all(backend: IoBackend, futures: list) -> None:
    """Wait for ``futures``, running queued pieces on this thread meanwhile (where the backend
    can), and raise the first error; never returns with a piece still in flight."""
    help_ = getattr(backend, "help", None)
    if help_ is not None:
        while not all(f.done() for f in futures) and help_():
            pass
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


_thread_buffers = threading.local()


def _thread_header_view() -> memoryview:
    """This thread's aligned 4 KiB header block, allocated once (a fresh one costs ~8 us)."""
    view = getattr(_thread_buffers, "header", None)
    if view is None:
        view = _thread_buffers.header = memoryview(aligned_empty(HEADER_BYTES).numpy())
    return view


def _header_block(header: ShardHeader) -> memoryview:
    """``header`` encoded in this thread's aligned 4 KiB block (reused: the block is written by
    this thread before it encodes the next header)."""
    view = _thread_header_view()
    view[:] = header.encode()
    return view


def write_tensor_file(
    path: str | os.PathLike,
    tensor: torch.Tensor,
    *,
    backend: IoBackend,
    o_direct: bool,
    fsync_dir: bool = False,
    staging: torch.Tensor | None = None,
    key: str | None = None,
    reuse: Path | None = None,
    keep_old_at: Path | None = None,
) -> int:
    """Write ``tensor`` to a shard file at ``path``, crash-safely. Returns the file's bytes.

    The bytes go to a temporary file next to ``path`` (``.NAME.tmp-UUID``), which is flushed with
    ``fdatasync`` and renamed over ``path``; with ``fsync_dir`` the directory is flushed too, so
    the rename itself survives a power cut. On any failure the temporary file is removed and
    whatever was at ``path`` before is untouched.

    ``tensor`` may be any CPU tensor. A contiguous one is written from its own memory (through a
    ``staging`` window when ``O_DIRECT`` needs alignment it lacks); a non-contiguous one is first
    copied whole, into ``staging`` if that is large enough, else into a fresh aligned buffer.
    ``key`` (default: the file name) is recorded in the header. The tensor must not be modified
    until this returns.

    Recycling (the NVMe store's swap files, see :class:`zinf.storage.nvme.SparePool`):
    ``reuse`` names a spare file of exactly the new file's length, written before and linked
    nowhere else, that becomes the "new" file instead of a fresh temporary one. Overwriting
    blocks that are already allocated and written is about twice as fast on ext4 as writing a
    new, preallocated file (measured: benchmarks/RESULTS.md). With ``keep_old_at``, the switch is
    an atomic exchange of the two names (``renameat2(RENAME_EXCHANGE)``), and the replaced
    version is left at ``keep_old_at`` instead of being deleted, for a later write to reuse.
    Returns as usual; whether the old version was kept is ``keep_old_at.exists()`` afterwards
    (it is not where the filesystem cannot exchange names, or when ``path`` did not exist).
    """
    path = path if isinstance(path, Path) else Path(path)
    if tensor.device.type != "cpu":
        raise ValueError(f"write_tensor_file takes CPU tensors; got one on {tensor.device}")
    _check_staging(staging)
    src = tensor.detach()
    nbytes = src.numel() * src.element_size()
    header = ShardHeader(
        key if key is not None else path.name, src.dtype, tuple(src.shape), nbytes, 0
    )
    header.encode()  # a key too long for the header fails here, before any file exists
    if src.is_contiguous():
        data = _bytes_of(src)
    else:
        padded_bytes = round_up(nbytes)
        use_staging = staging is not None and staging.numel() >= padded_bytes
        data = staging[:padded_bytes] if use_staging else aligned_empty(nbytes)
        data[:nbytes].view(src.dtype).view(src.shape).copy_(src)
        data[nbytes:padded_bytes].zero_()
        staging = None  # staging now holds the payload; it cannot also be a window buffer

    reusing = reuse is not None
    tmp = reuse if reusing else _tmp_path_for(path)
    plan = (
        _DirectPlan(data, nbytes, _block_bytes(backend), o_direct=o_direct)
        if _DirectPlan.suits(data, o_direct=o_direct)
        else None
    )
    # One O_DIRECT call with O_DSYNC is as durable as write + fdatasync (the kernel syncs inside
    # the call, a FUA write where no metadata changed) and saves a system call per file.
    dsync = plan is not None and plan.single_call and o_direct
    flags = os.O_WRONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0) | (os.O_DSYNC if dsync else 0)
    if not reusing:
        flags |= os.O_CREAT | os.O_EXCL
    with span("zinf.io.write"):
        try:
            fd = os.open(tmp, flags, 0o644)
        except OSError as e:
            raise _storage_error("write", path, e) from e
        try:
            try:
                if reusing:
                    if os.fstat(fd).st_size != header.file_bytes:
                        raise ValueError(f"spare file {tmp} has the wrong length for {path}")
                else:
                    _preallocate(fd, header.file_bytes)
                if plan is not None:
                    header = _write_direct(backend, fd, plan, data, header)
                else:  # unaligned memory under O_DIRECT: through the staging windows
                    transfer = _Transfer(backend, fd, "write", checksum=True)
                    crc = transfer.run(data, nbytes, o_direct=o_direct, staging=staging)
                    header = replace(header, crc32=crc)
                    _write_header(fd, header)
                # Either way the file is not at its name until it is durable and switched below,
                # so a crash mid-write leaves only a temporary or spare file behind.
                if not dsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            _switch(tmp, path, keep_old_at)
        except BaseException as e:
            _unlink_quietly(tmp)
            if isinstance(e, OSError) and not isinstance(e, ZinfError):
                raise _storage_error("write", path, e) from e
            raise
        if fsync_dir:
            _fsync_directory(path.parent)
    return header.file_bytes


def _block_bytes(backend: IoBackend) -> int:
    return getattr(backend, "block_size", ONE_CALL_MAX_BYTES)


def _write_direct(
    backend: IoBackend, fd: int, plan: _DirectPlan, data: torch.Tensor, header: ShardHeader
) -> ShardHeader:
    """Write header and payload per ``plan``: the backend writes all but the first block while
    this thread checksums the payload and then writes the header with the first block. Returns
    the header with its CRC."""
    plan.fill_tail(data)
    futures = plan.submit_rest(backend, fd, "write")
    try:
        header = replace(header, crc32=plan.crc())  # ISA-L, ~50 GB/s: overlaps the rest's I/O
        writev_full(fd, plan.first_call(_header_block(header)), 0)
    finally:
        _wait_all(backend, futures)  # never close the fd under a piece in flight
    return header


def _switch(new: Path, path: Path, keep_old_at: Path | None) -> None:
    """Put ``new`` at ``path`` atomically. With ``keep_old_at`` the names are exchanged where the
    filesystem can, and the old version moves on to ``keep_old_at``; otherwise it is deleted."""
    if keep_old_at is not None and exchange_names(new, path):
        if new != keep_old_at:
            os.replace(new, keep_old_at)
        return
    os.replace(new, path)


_RENAME_EXCHANGE = 2  # linux/fs.h
_exchange_supported: bool | None = None  # learnt on first use; None = not tried yet


def exchange_names(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs,
    btrfs, tmpfs). False, with nothing changed, where unsupported or when ``b`` is missing."""
    global _exchange_supported
    if _exchange_supported is False:
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "renameat2"):
        _exchange_supported = False
        return False
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        _exchange_supported = True
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        _exchange_supported = False
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def read_tensor_file(
    path: str | os.PathLike,
    *,
    backend: IoBackend,
    o_direct: bool,
    out: torch.Tensor | None = None,
    verify: bool = True,
    staging: torch.Tensor | None = None,
    key: str | None = None,
) -> torch.Tensor:
    """Read the shard file at ``path``.

    With ``out`` (a contiguous CPU tensor of exactly the payload's bytes, any dtype) the bytes
    land in ``out``, which is returned; otherwise a new tensor of the stored dtype and shape is
    returned (its memory is 4096-aligned). With ``verify`` every payload byte is checked against
    the header's CRC-32. ``staging`` is used when ``O_DIRECT`` needs alignment ``out`` lacks.
    ``key``, when given, must match the header's key and names the shard in error messages.

    Raises :class:`CorruptShardError` for a bad header, a wrong length or a checksum mismatch,
    and :class:`StorageError` when the file is missing or cannot be read.
    """
    path = path if isinstance(path, Path) else Path(path)
    _check_staging(staging)
    flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0)
    with span("zinf.io.read"):
        try:
            fd = os.open(path, flags)
        except OSError as e:
            what = f" (key {key!r})" if key is not None else ""
            if e.errno == errno.ENOENT:
                err = StorageError(f"shard file {path}{what} does not exist")
                err.errno = e.errno
                raise err from e
            raise _storage_error("read", path, e) from e
        try:
            if out is not None:
                fast = _read_direct(fd, path, key, out, backend, o_direct=o_direct, verify=verify)
                if fast is not None:
                    return out
            header = _read_header_fd(fd, path, key)
            nbytes = header.nbytes
            if out is None:
                data = aligned_empty(nbytes)
                result = data[:nbytes].view(header.dtype).view(header.shape)
            else:
                out_bytes = out.numel() * out.element_size()
                if out.device.type != "cpu" or not out.is_contiguous() or out_bytes != nbytes:
                    raise _wrong_out(path, header, out)
                data = _bytes_of(out)
                result = out
            transfer = _Transfer(backend, fd, "read", checksum=verify)
            crc = transfer.run(data, nbytes, o_direct=o_direct, staging=staging)
        except ShortTransferError as e:
            raise _corrupt(path, key, f"it was cut short while being read ({e})") from e
        except OSError as e:
            if isinstance(e, ZinfError):
                raise
            raise _storage_error("read", path, e) from e
        finally:
            os.close(fd)
    if verify and crc != header.crc32:
        raise _checksum_mismatch(path, key, header, crc)
    return result


def _wrong_out(path: Path, header: ShardHeader, out: torch.Tensor) -> ValueError:
    return ValueError(
        f"out must be a contiguous CPU tensor of {header.nbytes} bytes to hold {path} "
        f"({header.dtype} of shape {list(header.shape)}); got {out.numel() * out.element_size()} "
        f"bytes on {out.device}, contiguous={out.is_contiguous()}"
    )


def _read_direct(
    fd: int, path: Path, key: str | None, out: torch.Tensor, backend: IoBackend, *, o_direct: bool,
    verify: bool,
) -> ShardHeader | None:
    """Read header and payload straight into ``out``: this thread reads the header with the first
    block in one vectored call while the backend reads the rest (a small file is one call).
    None (nothing read) when the file or ``out`` does not suit that; the caller then takes the
    general path, which also produces the precise error for a damaged file."""
    if out.device.type != "cpu" or not out.is_contiguous():
        return None
    data = _bytes_of(out)
    nbytes = data.numel()
    if not _DirectPlan.suits(data, o_direct=o_direct):
        return None
    if os.fstat(fd).st_size != HEADER_BYTES + round_up(nbytes):
        return None
    # out holds exactly the payload, so under O_DIRECT a partial last block goes through the
    # plan's tail buffer rather than past the end of out.
    plan = _DirectPlan(data, nbytes, _block_bytes(backend), o_direct=o_direct)
    head = _thread_header_view()  # decoded (copied out by bytes()) before this thread reads again
    futures = plan.submit_rest(backend, fd, "read")
    try:
        readv_full(fd, plan.first_call(head), 0)
    finally:
        _wait_all(backend, futures)
    header = ShardHeader.decode(bytes(head), path, key)
    if header.nbytes != nbytes:
        raise _wrong_out(path, header, out)
    plan.drain_tail(data)
    if verify:
        crc = plan.crc()
        if crc != header.crc32:
            raise _checksum_mismatch(path, key, header, crc)
    return header


def copy_tensor_file(
    src: str | os.PathLike, dest: str | os.PathLike, *, fsync_dir: bool = False
) -> int:
    """Copy a shard file, checking the payload's CRC-32 on the way; crash-safe like a write.

    Uses buffered I/O in :data:`COPY_CHUNK_BYTES` pieces, so it needs little memory. A corrupt
    source raises :class:`CorruptShardError` and leaves nothing at ``dest``. Returns the bytes
    copied (the whole file).
    """
    src, dest = Path(src), Path(dest)
    try:
        src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _storage_error("read", src, e) from e
    tmp = _tmp_path_for(dest)
    try:
        header = _read_header_fd(src_fd, src, None)
        try:
            dest_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _storage_error("write", dest, e) from e
        try:
            _preallocate(dest_fd, header.file_bytes)
            chunk = bytearray(min(COPY_CHUNK_BYTES, max(header.file_bytes - HEADER_BYTES, 1)))
            crc = 0
            for offset in range(HEADER_BYTES, header.file_bytes, len(chunk)):
                view = memoryview(chunk)[: min(len(chunk), header.file_bytes - offset)]
                with span("zinf.io.read"):
                    read_full(src_fd, view, offset)
                payload_bytes = max(0, min(len(view), HEADER_BYTES + header.nbytes - offset))
                crc = payload_crc32(view[:payload_bytes], crc)
                with span("zinf.io.write"):
                    write_full(dest_fd, view, offset)
            if crc != header.crc32:
                raise _corrupt(
                    src,
                    header.key,
                    f"checksum mismatch (header crc32 {header.crc32:#010x}, payload {crc:#010x})",
                )
            with span("zinf.io.write"):
                write_full(dest_fd, memoryview(header.encode()), 0)
            os.fdatasync(dest_fd)
        finally:
            os.close(dest_fd)
        os.replace(tmp, dest)
    except BaseException as e:
        _unlink_quietly(tmp)
        if isinstance(e, ShortTransferError):
            raise _corrupt(src, None, f"it was cut short while being read ({e})") from e
        if isinstance(e, OSError) and not isinstance(e, ZinfError):
            raise _storage_error("copy to", dest, e) from e
        raise
    finally:
        os.close(src_fd)
    if fsync_dir:
        _fsync_directory(dest.parent)
    return header.file_bytes


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory, so that renames and new entries in it survive a power cut."""
    _fsync_directory(Path(path))
