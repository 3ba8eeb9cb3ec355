"""Page-aligned host buffers, and a fixed pool of them for staging copies.

``O_DIRECT`` I/O bypasses the page cache, so the kernel DMAs straight between the device and our
memory: the buffer address, the file offset and the length must all be multiples of the logical
block size. 4096 covers every common device (512-byte and 4K-native), so everything here is
aligned to :data:`ALIGN`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ALIGN = 4096  # bytes; the alignment O_DIRECT needs of addresses, offsets and lengths


def round_up(n: int, a: int = ALIGN) -> int:
    """The smallest multiple of ``a`` that is at least ``n``."""
    return (n + a - 1) // a * a


def round_down(n: int, a: int = ALIGN) -> int:
    """The largest multiple of ``a`` that is at most ``n``."""
    return n // a * a


def is_aligned(t: torch.Tensor, a: int = ALIGN) -> bool:
    """Whether the tensor's first byte sits at an address that is a multiple of ``a``."""
    return t.data_ptr() % a == 0


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``round_up(nbytes)`` bytes whose first byte is 4096-aligned.

    The tensor is a slice of a slightly larger allocation; the slice holds a reference to that
    allocation, so it stays alive as long as the returned tensor (or any view of it) does.
    With ``pin`` (and only where CUDA is available) the memory is page-locked, so host-to-device
    copies from it can be asynchronous.
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    length_bytes = round_up(nbytes)
    pin = pin and torch.cuda.is_available()
    # One spare page, so that an aligned start exists inside the allocation wherever it lands.
    raw = torch.empty(length_bytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    offset_bytes = (-raw.data_ptr()) % ALIGN
    return raw[offset_bytes : offset_bytes + length_bytes]


class StagingPool:
    """A fixed set of ``count`` aligned buffers of ``buffer_bytes`` each, handed out one at a time.

    The pool allocates everything up front and never more, so its :attr:`total_bytes` is a hard
    bound to count against the DRAM budget. :meth:`acquire` blocks while all buffers are in use.

    >>> pool = StagingPool(1 << 20, 2)
    >>> with pool.buffer() as buf:
    ...     buf.numel()
    1048576
    """

    def __init__(self, buffer_bytes: int, count: int, pin: bool = False) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError(
                f"StagingPool needs buffer_bytes > 0 and count > 0, got {buffer_bytes} and {count}"
            )
        self.buffer_bytes = round_up(buffer_bytes)
        self.count = count
        self._buffers = [aligned_empty(self.buffer_bytes, pin=pin) for _ in range(count)]
        self._free = list(self._buffers)
        self._in_use_ptrs: set[int] = set()
        self._cond = threading.Condition()

    @property
    def total_bytes(self) -> int:
        """Bytes of host memory the pool holds (excluding the one alignment page per buffer)."""
        return self.buffer_bytes * self.count

    @property
    def in_use(self) -> int:
        """How many buffers are acquired and not yet released."""
        with self._cond:
            return len(self._in_use_ptrs)

    def acquire(self, timeout_s: float | None = None) -> torch.Tensor:
        """Take a free buffer, waiting up to ``timeout_s`` seconds (forever when None) for one."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                raise TimeoutError(
                    f"no staging buffer became free within {timeout_s} s (all {self.count} of "
                    f"{self.buffer_bytes} bytes are in use); release buffers after use or "
                    f"raise staging_count"
                )
            buf = self._free.pop()
            self._in_use_ptrs.add(buf.data_ptr())
            return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer that :meth:`acquire` returned."""
        with self._cond:
            ptr = buf.data_ptr()
            if ptr not in self._in_use_ptrs:
                raise ValueError(
                    "release() of a buffer that is not an acquired buffer of this pool"
                )
            self._in_use_ptrs.remove(ptr)
            # Put back our own tensor object, not the caller's (which may be a view of it).
            self._free.append(next(b for b in self._buffers if b.data_ptr() == ptr))
            self._cond.notify()

    @contextmanager
    def buffer(self, timeout_s: float | None = None) -> Iterator[torch.Tensor]:
        """``with pool.buffer() as buf:`` acquires a buffer and releases it on exit."""
        buf = self.acquire(timeout_s)
        try:
            yield buf
        finally:
            self.release(buf)


class BufferPool:
    """Aligned buffers of any size, recycled by size: a freed buffer serves the next request of
    the same rounded size, so the steady state allocates nothing.

    Shards come in few distinct sizes (every layer of a transformer has the same ones), so reuse
    is high. Recycling matters for speed: a fresh allocation of a large buffer is fresh pages,
    and the kernel faults every one of them in during the first O_DIRECT read into it. At most
    ``max_free_bytes`` of free buffers are kept; the rest go back to the allocator.
    """

    def __init__(self, max_free_bytes: int, pin: bool = False) -> None:
        self.max_free_bytes = max_free_bytes
        self.pin = pin
        self.free_bytes = 0
        self.in_use_bytes = 0  # handed out by get() and not yet put back
        self.peak_in_use_bytes = 0  # the most ever handed out at once (for tests and stats)
        self.allocated = 0  # buffers created since the pool was made (for tests and stats)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 aligned buffer of ``round_up(nbytes)`` bytes (contents undefined)."""
        size = round_up(nbytes)
        with self._lock:
            free = self._free.get(size)
            self.in_use_bytes += size
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            if free:
                self.free_bytes -= size
                return free.pop()
            self.allocated += 1
        return aligned_empty(size, pin=self.pin)

    def put(self, buf: torch.Tensor) -> None:
        """Give back a buffer from :meth:`get` (it must no longer be used)."""
        size = buf.numel()
        with self._lock:
            self.in_use_bytes -= size
            if self.free_bytes + size <= self.max_free_bytes:
                self._free.setdefault(size, []).append(buf)
                self.free_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.free_bytes = 0
