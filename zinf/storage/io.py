"""Block I/O backends: move bytes between a file descriptor and a memory buffer.

:class:`IoBackend` is the small interface the shard files are written against, so that a libaio,
io_uring or GPUDirect Storage backend can be added later without touching the callers. The one
backend today, :class:`ThreadPoolBackend`, splits each request into blocks and runs them on worker
threads with ``os.preadv``/``os.pwritev``, which release the GIL while the kernel works.

Buffers are ``memoryview`` objects over writable memory (for a uint8 tensor ``t``:
``memoryview(t.numpy())``). For ``O_DIRECT`` descriptors the caller must pass buffer addresses,
offsets and lengths that are multiples of the alignment (see :mod:`zinf.storage.aligned`), and a
block size that is one too.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Protocol, runtime_checkable


class ShortTransferError(OSError):
    """A read hit end of file (or a write made no progress) before the whole buffer was moved."""


@runtime_checkable
class IoBackend(Protocol):
    """Asynchronous positional I/O on file descriptors. Futures resolve to the bytes moved."""

    def pread(self, fd: int, buf: memoryview, offset: int) -> Future[int]:
        """Fill all of ``buf`` from ``fd`` starting at ``offset``."""
        ...

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> Future[int]:
        """Write all of ``buf`` to ``fd`` starting at ``offset``."""
        ...

    def close(self) -> None:
        """Finish queued requests and stop; later requests raise ``RuntimeError``."""
        ...

    # Optional: ``help() -> bool`` runs one queued piece on the calling thread (False when none
    # is queued). Callers that are about to wait use it where present (see ThreadPoolBackend).


def read_full(fd: int, buf: memoryview, offset: int) -> int:
    """Synchronously fill all of ``buf`` from ``fd`` at ``offset``, looping over short reads."""
    return readv_full(fd, [buf], offset)


def write_full(fd: int, buf: memoryview, offset: int) -> int:
    """Synchronously write all of ``buf`` to ``fd`` at ``offset``, looping over short writes."""
    return writev_full(fd, [buf], offset)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes (after a short vectored transfer)."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out


def readv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Synchronously fill all of ``bufs`` (one after another) from ``fd`` at ``offset`` with as
    few ``preadv`` calls as the kernel allows (normally one)."""
    total_bytes = sum(len(b) for b in bufs)
    done_bytes = 0
    while bufs:
        n = os.preadv(fd, bufs, offset + done_bytes)
        if n == 0:
            raise ShortTransferError(
                f"end of file at offset {offset + done_bytes}: {total_bytes - done_bytes} bytes "
                f"of a {total_bytes}-byte read are missing"
            )
        done_bytes += n
        bufs = _advance(bufs, n)
    return done_bytes


def writev_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Synchronously write all of ``bufs`` (one after another) to ``fd`` at ``offset`` with as
    few ``pwritev`` calls as the kernel allows (normally one)."""
    total_bytes = sum(len(b) for b in bufs)
    done_bytes = 0
    while bufs:
        n = os.pwritev(fd, bufs, offset + done_bytes)
        if n == 0:
            raise ShortTransferError(
                f"write made no progress at offset {offset + done_bytes} "
                f"({total_bytes - done_bytes} bytes left)"
            )
        done_bytes += n
        bufs = _advance(bufs, n)
    return done_bytes


class _Request:
    """One pread/pwrite call: its future and how many of its blocks are still outstanding."""

    __slots__ = ("future", "remaining", "total_bytes", "error", "lock")

    def __init__(self, future: Future[int], pieces: int, total_bytes: int) -> None:
        self.future = future
        self.remaining = pieces
        self.total_bytes = total_bytes
        self.error: Exception | None = None
        self.lock = threading.Lock()

    def piece_done(self, error: Exception | None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            finished = self.remaining == 0
        if finished:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.total_bytes)


class ThreadPoolBackend:
    """Splits each request into ``block_size`` pieces and runs them on ``thread_count`` threads.

    At most ``queue_depth`` pieces are inside a system call at any time (so with threads the
    effective depth is ``min(queue_depth, thread_count)``); the rest wait in a FIFO queue, so
    requests are served in the order they were made. A request's future completes when all of
    its pieces are done; if any piece fails, the future carries the first ``OSError`` and the
    pieces not yet started are skipped.
    """

    def __init__(
        self, block_size: int = 1 << 20, queue_depth: int = 8, thread_count: int = 4
    ) -> None:
        if block_size <= 0 or queue_depth <= 0 or thread_count <= 0:
            raise ValueError(
                "ThreadPoolBackend needs block_size, queue_depth and thread_count > 0, got "
                f"{block_size}, {queue_depth}, {thread_count}"
            )
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = threading.BoundedSemaphore(queue_depth)
        self._closed = False
        self._close_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._worker, name=f"zinf-io-{i}", daemon=True)
            for i in range(thread_count)
        ]
        for t in self._threads:
            t.start()

    def pread(self, fd: int, buf: memoryview, offset: int) -> Future[int]:
        return self._submit(read_full, fd, buf, offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> Future[int]:
        return self._submit(write_full, fd, buf, offset)

    def close(self) -> None:
        """Let queued pieces finish, then stop the worker threads. Safe to call twice."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)  # one stop marker per worker, behind all queued work
        for t in self._threads:
            t.join()

    def __enter__(self) -> ThreadPoolBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn, fd: int, buf: memoryview, offset: int) -> Future[int]:
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        total_bytes = len(buf)
        future: Future[int] = Future()
        future.set_running_or_notify_cancel()  # requests cannot be cancelled once made
        if total_bytes == 0:
            future.set_result(0)
            return future
        starts = range(0, total_bytes, self.block_size)
        request = _Request(future, len(starts), total_bytes)
        with self._close_lock:
            if self._closed:
                raise RuntimeError("ThreadPoolBackend is closed")
            for start in starts:
                piece = buf[start : start + self.block_size]
                self._queue.put((request, fn, fd, piece, offset + start))
        return future

    def help(self) -> bool:
        """Run one queued piece on the calling thread; False when none is queued.

        A caller about to wait for its own request calls this instead: the piece starts at once
        rather than after a worker thread wakes up (tens of microseconds on a busy VM, a large
        share of a 1 MiB transfer), and the caller adds a thread's worth of I/O."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return False
        if item is None:  # a stop marker belongs to a worker: hand it back
            self._queue.put(None)
            return False
        self._run(item)
        return True

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(item)

    def _run(self, item) -> None:
        request, fn, fd, piece, offset = item
        error: Exception | None = None
        if request.error is None:  # skip the rest of a request that already failed
            try:
                with self._in_flight:
                    fn(fd, piece, offset)
            except Exception as e:  # OSError normally; anything else must fail the future too
                error = e
        request.piece_done(error)
