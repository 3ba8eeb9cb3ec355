"""The NVMe swap store of one training run: one shard file per key in a private run directory.

Layout under the configured ``nvme_path`` (``root``)::

    root/
      zinf-<run>/            one per running (or killed) run
        ZINF_SWAP            marker: JSON with pid, hostname, start time
        owner.lock           flock'ed (exclusive) by the owning process for the store's lifetime
        <key>.shard          one file per key (see zinf.storage.shardfile)

A run killed with SIGKILL cannot remove its directory, but the kernel drops its lock. So at
open, every sibling ``zinf-*`` directory that has a marker and whose lock can be taken is a
leftover, and is removed (with a warning). Directories without the marker are never touched,
nor are ones whose lock a live process holds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import quote, unquote

import torch

from zinf.errors import StorageError
from zinf.storage.aligned import ALIGN, StagingPool, round_up
from zinf.storage.fsinfo import filesystem_of, probe_o_direct
from zinf.storage.inflight import for_path as _inflight_for
from zinf.storage.io import ThreadPoolBackend
from zinf.storage.requests import RequestThreads
from zinf.threads import single_threaded_torch
from zinf.storage.shardfile import (
    HEADER_BYTES,
    copy_tensor_file,
    fsync_dir as _fsync_dir,
    needs_staging,
    read_header,
    read_tensor_file,
    write_tensor_file,
)

MARKER_NAME = "ZINF_SWAP"
LOCK_NAME = "owner.lock"
RUN_DIR_PREFIX = "zinf-"
SHARD_SUFFIX = ".shard"

# (op, key, payload bytes, seconds, concurrency: mean requests in flight on the disk meanwhile, itself included)
Listener = Callable[[str, str, int, float, float], None]


def _request_threads(thread_count: int) -> RequestThreads:
    """The threads that run asynchronous requests, urgent ones first; their staging copies stay
    on the thread (no OpenMP team of their own: see zinf.threads)."""
    return RequestThreads(max(2, thread_count), name="zinf-nvme", initializer=single_threaded_torch)


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def _file_name_of(key: str) -> str:
    """A file name for ``key``: percent-encoded so any key is safe, never starting with "."
    (temporary files do)."""
    if not key:
        raise ValueError("NvmeStore keys must be non-empty strings")
    name = quote(key, safe="-_.=+,@")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) + len(SHARD_SUFFIX) + 48 > 255:  # room for the ".NAME.tmp-UUID" of writes
        raise ValueError(f"NvmeStore key is too long for a file name: {key[:80]!r}...")
    return name + SHARD_SUFFIX


def _try_lock(lock_path: Path) -> int | None:
    """Open ``lock_path`` and take an exclusive flock without waiting: the fd, or None when a
    live process holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class SparePool:
    """Replaced versions of swap files, kept to be overwritten by later writes of the same length.

    Every write of a swap file is write-new -> fdatasync -> switch -> retire-old. Writing the new
    version into a fresh file costs a create and an allocation, and on ext4 the first write into
    freshly allocated blocks runs at about half the speed of overwriting written ones. So the
    retired version is not deleted but kept here (under a hidden ``.spare-*`` name, invisible to
    :meth:`NvmeStore.keys`) and the next write of that length overwrites it. A file linked
    elsewhere (a checkpoint holds a hard link to it) is never kept: overwriting it would change
    the checkpoint.

    Bounded two ways: at most ``per_length`` spares of one length (writes in flight at once need
    no more), and at most ``total_bytes`` on disk in all, which counts as swap space.
    """

    def __init__(self, run_dir: Path, total_bytes: int, per_length: int) -> None:
        self.run_dir = run_dir
        self.total_bytes = total_bytes
        self.per_length = per_length
        self.held_bytes = 0
        self._by_length: dict[int, list[Path]] = {}
        self._lock = threading.Lock()

    def new_name(self) -> Path:
        return self.run_dir / f".spare-{uuid.uuid4().hex}{SHARD_SUFFIX}"

    def take(self, file_bytes: int) -> Path | None:
        """A spare of exactly ``file_bytes``, now owned by the caller, or None."""
        with self._lock:
            spares = self._by_length.get(file_bytes)
            if not spares:
                return None
            self.held_bytes -= file_bytes
            return spares.pop()

    def has_room(self, file_bytes: int) -> bool:
        with self._lock:
            return (
                self.held_bytes + file_bytes <= self.total_bytes
                and len(self._by_length.get(file_bytes, ())) < self.per_length
            )

    def give(self, path: Path) -> None:
        """Keep ``path`` as a spare if it is linked nowhere else and there is room; else delete."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        with self._lock:
            spares = self._by_length.setdefault(st.st_size, [])
            if (
                st.st_nlink == 1
                and self.held_bytes + st.st_size <= self.total_bytes
                and len(spares) < self.per_length
            ):
                spares.append(path)
                self.held_bytes += st.st_size
                return
        path.unlink(missing_ok=True)


class NvmeStore:
    """Swap files of one training run under ``root``.

    ``block_size``, ``queue_depth`` and ``thread_count`` configure the I/O backend;
    ``staging_bytes`` x ``staging_count`` aligned buffers (pinned with ``pin_memory`` where CUDA
    exists) stage tensors whose memory ``O_DIRECT`` cannot use directly; their size is
    :attr:`staging_bytes_total`, to count against the DRAM budget. Up to ``spare_bytes`` of disk
    hold retired versions of files for reuse (:class:`SparePool`). ``listener(op, key, nbytes,
    seconds, concurrency)`` is called after each whole-file read or write ("read"/"write", payload
    bytes; ``concurrency`` from :mod:`zinf.storage.inflight`).

    Reads and writes of different keys may run concurrently from any threads. Use as a context
    manager, or call :meth:`close`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        run_name: str | None = None,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        thread_count: int = 4,
        pin_memory: bool = False,
        staging_bytes: int = 8 << 20,
        staging_count: int = 4,
        spare_bytes: int = 256 << 20,
        listener: Listener | None = None,
    ) -> None:
        if run_name is not None and (not run_name or "/" in run_name or run_name in (".", "..")):
            raise ValueError(f"run_name must be a plain file name, got {run_name!r}")
        if block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN}, got {block_size}")
        self.root = Path(os.path.abspath(Path(root).expanduser()))
        self.listener = listener
        self.cleaned_dirs: list[Path] = []
        self.bytes_read = 0
        self.bytes_written = 0
        self._counter_lock = threading.Lock()
        self._index: dict[str, int] = {}  # key -> payload bytes, for keys this store wrote
        self._index_lock = threading.Lock()
        self._paths: dict[str, Path] = {}  # key -> its file (dict reads and writes are atomic)
        self._pending: dict[str, Future] = {}  # key -> its newest asynchronous write in flight
        self._pending_lock = threading.Lock()
        self._closed = False
        self._lock_fd: int | None = None
        self._run_dir_created = False
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        # Allocated first: it touches nothing on disk, so a failure here leaves nothing behind.
        self._staging = StagingPool(staging_bytes, staging_count, pin=pin_memory)

        created_dirs = self._validate_root()
        self._clean_stale_run_dirs()
        name = run_name or uuid.uuid4().hex[:8]
        self.run_dir = self.root / f"{RUN_DIR_PREFIX}{name}"
        try:
            self._claim_run_dir()
            self.o_direct = self._probe_o_direct()
        except BaseException:
            self._abandon(created_dirs)
            raise

        self._backend = ThreadPoolBackend(block_size, queue_depth, thread_count)
        self._inflight = _inflight_for(self.run_dir)  # requests in flight on this disk, for the listener
        # Async requests run the synchronous code on these threads; the block I/O itself runs
        # on the backend's threads.
        self._requests = _request_threads(thread_count)
        # Writes in flight at once: the request threads plus the caller's own thread.
        self._spares = SparePool(self.run_dir, spare_bytes, per_length=max(2, thread_count) + 1)

    # ----------------------------------------------------------------------------------------
    # Opening

    def _validate_root(self) -> list[Path]:
        """Check (creating it if missing) that ``root`` is a writable directory. Returns the
        directories created, so a failed construction can remove them."""
        root = self.root
        if root.exists() and not root.is_dir():
            raise StorageError(
                f"nvme_path {root} is a file, not a directory; point nvme_path at a directory"
            )
        created: list[Path] = []
        if not root.exists():
            missing = [root, *[p for p in root.parents if not p.exists()]]
            try:
                root.mkdir(parents=True)
            except OSError as e:
                self._remove_created([p for p in missing if p.is_dir()])
                raise StorageError(
                    f"nvme_path {root} cannot be created ({e.strerror}); create it or point "
                    f"nvme_path at an existing writable directory"
                ) from e
            created = missing  # deepest first
        probe = root / f".zinf-write-probe-{uuid.uuid4().hex[:12]}"
        try:
            if not os.access(root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "permission denied")
            with open(probe, "wb") as f:
                f.write(b"zinf")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as e:
            try:
                probe.unlink()
            except OSError:
                pass
            self._remove_created(created)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(
                    f"nvme_path {root} is full ({e.strerror}); free space or point nvme_path "
                    f"elsewhere"
                ) from e
            raise StorageError(
                f"nvme_path {root} is not writable ({e.strerror or e}); fix its permissions or "
                f"point nvme_path at a writable directory"
            ) from e
        return created

    @staticmethod
    def _remove_created(created_dirs: list[Path]) -> None:
        for d in created_dirs:  # deepest first; rmdir only removes what is still empty
            try:
                d.rmdir()
            except OSError:
                pass

    def _clean_stale_run_dirs(self) -> None:
        """Remove leftovers of killed runs: marked run dirs whose lock nobody holds."""
        for d in sorted(self.root.glob(f"{RUN_DIR_PREFIX}*")):
            if not d.is_dir() or d.is_symlink() or not (d / MARKER_NAME).is_file():
                continue
            try:
                fd = _try_lock(d / LOCK_NAME)
            except OSError:
                continue  # cannot even open its lock (permissions): not ours to judge
            if fd is None:
                continue  # a live run holds it
            try:
                if not (d / MARKER_NAME).is_file():
                    continue  # someone else cleaned it while we took the lock
                owner = self._read_marker(d)
                shutil.rmtree(d, ignore_errors=True)
            finally:
                os.close(fd)
            self.cleaned_dirs.append(d)
            warnings.warn(
                f"removed {d}: swap directory left by a run that ended without cleaning up "
                f"({owner})",
                stacklevel=3,
            )

    @staticmethod
    def _read_marker(d: Path) -> str:
        try:
            info = json.loads((d / MARKER_NAME).read_text())
            return f"pid {info.get('pid')} on {info.get('hostname')}, started {info.get('started')}"
        except (OSError, ValueError):
            return "unreadable marker"

    def _claim_run_dir(self) -> None:
        """Create the run dir, lock it, then write the marker (in that order, so a marker is
        only ever seen next to a lock held by its live owner)."""
        try:
            self.run_dir.mkdir()
        except FileExistsError as e:
            raise StorageError(
                f"swap directory {self.run_dir} is in use by another run (or is not a zinf swap "
                f"directory); choose another run_name"
            ) from e
        except OSError as e:
            raise StorageError(f"cannot create swap directory {self.run_dir}: {e.strerror}") from e
        self._run_dir_created = True
        self._lock_fd = _try_lock(self.run_dir / LOCK_NAME)
        if self._lock_fd is None:
            raise StorageError(
                f"swap directory {self.run_dir} was taken by another run while opening"
            )
        marker = {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "started_unix_s": time.time(),
        }
        tmp = self.run_dir / f".{MARKER_NAME}.tmp"
        tmp.write_text(json.dumps(marker) + "\n")
        os.replace(tmp, self.run_dir / MARKER_NAME)

    def _probe_o_direct(self) -> bool:
        try:
            supported = probe_o_direct(self.run_dir)
        except OSError as e:
            raise StorageError(
                f"cannot write to {self.run_dir} ({e.strerror}); free space or point nvme_path "
                f"elsewhere"
            ) from e
        if not supported:
            fs = filesystem_of(self.run_dir)
            warnings.warn(
                f"O_DIRECT refused on {fs.fstype} at {self.run_dir}; using buffered I/O (slower, "
                f"uses page cache)",
                stacklevel=3,
            )
        return supported

    def _abandon(self, created_dirs: list[Path]) -> None:
        """Undo a construction that failed after the run dir was (maybe) created."""
        if self._run_dir_created:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._remove_created(created_dirs)

    # ----------------------------------------------------------------------------------------
    # Keys and files

    def path(self, key: str) -> Path:
        """The file that holds ``key`` (whether or not it exists yet)."""
        path = self._paths.get(key)
        if path is None:  # built once per key: quoting and joining cost ~15 us a transfer
            path = self._paths[key] = self.run_dir / _file_name_of(key)
        return path

    def exists(self, key: str) -> bool:
        with self._pending_lock:
            if key in self._pending:
                return True  # its write is in flight
        return self.path(key).is_file()

    def keys(self) -> list[str]:
        """The keys that have a file, sorted."""
        names = [
            p.name for p in self.run_dir.glob(f"*{SHARD_SUFFIX}") if not p.name.startswith(".")
        ]
        return sorted(unquote(n[: -len(SHARD_SUFFIX)]) for n in names)

    def nbytes(self, key: str) -> int:
        """The payload bytes stored under ``key`` (without header and padding)."""
        with self._index_lock:
            known = self._index.get(key)
        return known if known is not None else read_header(self.path(key)).nbytes

    def delete(self, key: str) -> None:
        """Remove ``key``'s file; removing a key that does not exist is not an error."""
        self._check_open()
        self._wait_pending(key)
        path = self.path(key)
        spare = self._spares.new_name()
        try:
            os.rename(path, spare)  # retire it: the pool keeps it for reuse or deletes it
        except FileNotFoundError:
            pass
        else:
            self._spares.give(spare)
        with self._index_lock:
            self._index.pop(key, None)

    # ----------------------------------------------------------------------------------------
    # Transfers

    def write(self, key: str, tensor: torch.Tensor) -> int:
        """Write ``tensor`` under ``key``, replacing any previous version crash-safely.
        Returns the bytes of the file written (header and padding included)."""
        self._check_open()
        self._wait_pending(key)
        return self._write_now(key, tensor)

    def _write_now(self, key: str, tensor: torch.Tensor) -> int:
        ticket = self._inflight.enter()
        try:
            file_bytes = self._write_file(key, tensor)
        except BaseException:
            self._inflight.leave(ticket)  # a failed request leaves the count too
            raise
        self._account("write", key, tensor.numel() * tensor.element_size(), ticket)
        return file_bytes

    def _write_file(self, key: str, tensor: torch.Tensor) -> int:
        path = self.path(key)
        kwargs = dict(backend=self._backend, o_direct=self.o_direct, key=key)
        padded_bytes = round_up(tensor.numel() * tensor.element_size())
        # Overwrite a retired file of the same length if one is spare; retire the old version.
        kwargs["reuse"] = spare = self._spares.take(HEADER_BYTES + padded_bytes)
        # After the exchange the spare's own name holds the old version: keep it there (one
        # rename, not two); a fresh write retires the old version under a new spare name.
        kwargs["keep_old_at"] = keep_old_at = spare if spare is not None else self._spares.new_name()
        # A non-contiguous tensor is copied whole, so staging only helps when it fits.
        fits = tensor.is_contiguous() or padded_bytes <= self._staging.buffer_bytes
        try:
            if needs_staging(tensor, o_direct=self.o_direct) and fits:
                with self._staging.buffer() as staging:
                    file_bytes = write_tensor_file(path, tensor, staging=staging, **kwargs)
            else:
                file_bytes = write_tensor_file(path, tensor, **kwargs)
        except ValueError:
            if spare is None:
                raise
            # the spare was not what it should be: forget it and write a fresh file
            spare.unlink(missing_ok=True)
            kwargs["reuse"] = None
            file_bytes = write_tensor_file(path, tensor, **kwargs)
        self._spares.give(keep_old_at)
        nbytes = tensor.numel() * tensor.element_size()
        with self._index_lock:
            self._index[key] = nbytes
        return file_bytes

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``key`` into ``out`` (contiguous, of the stored byte size) or a new tensor,
        verifying its checksum. Raises ``StorageError`` for a missing key and
        ``CorruptShardError`` for a damaged file."""
        self._check_open()
        self._wait_pending(key)
        ticket = self._inflight.enter()
        kwargs = dict(backend=self._backend, o_direct=self.o_direct, out=out, key=key)
        try:
            if out is not None and needs_staging(out, o_direct=self.o_direct) and out.is_contiguous():
                with self._staging.buffer() as staging:
                    result = read_tensor_file(self.path(key), staging=staging, **kwargs)
            else:
                result = read_tensor_file(self.path(key), **kwargs)
        except BaseException:
            self._inflight.leave(ticket)
            raise
        self._account("read", key, result.numel() * result.element_size(), ticket)
        return result

    def read_async(self, key: str, out: torch.Tensor | None = None, *, urgent: bool = False) -> Future[torch.Tensor]:
        """:meth:`read` on a background thread; ``out`` must not be used until the future is
        done. A read of a key whose asynchronous write is still in flight waits for it.

        ``urgent``: someone waits for it now; it starts before every request not urgent that has
        not started (see zinf.storage.requests). Not while a write of the key is in flight:
        the read must follow it, and a thread blocked on a queued write serves nothing."""
        self._check_open()
        future = self._requests.submit(self.read, key, out, urgent=urgent and not self._write_pending(key))
        future.zinf_key = key
        return future

    def hurry(self, future: Future) -> bool:
        """Someone waits for this :meth:`read_async` now: start it before the requests not
        urgent still queued. False when it started already (or follows a write in flight)."""
        key = getattr(future, "zinf_key", None)
        if key is None or future.done() or self._write_pending(key):
            return False
        return self._requests.promote(future)

    def _write_pending(self, key: str) -> bool:
        with self._pending_lock:
            return key in self._pending

    def write_async(self, key: str, tensor: torch.Tensor) -> Future[int]:
        """:meth:`write` on a background thread. The tensor is written from its own memory, so
        it must not be modified (nor its memory reused) until the future completes.

        Operations on one key keep the order they were asked in: a later read, write, delete or
        link of ``key`` first waits for this write (and raises its error, if it failed)."""
        self._check_open()
        with self._pending_lock:
            before = self._pending.get(key)
            future = self._requests.submit(self._write_after, key, tensor, before)
            self._pending[key] = future
        future.add_done_callback(lambda f, key=key: self._write_done(key, f))
        return future

    def _write_after(self, key: str, tensor: torch.Tensor, before: Future | None) -> int:
        if before is not None:
            before.result()
        return self._write_now(key, tensor)

    def _write_done(self, key: str, future: Future) -> None:
        with self._pending_lock:
            if self._pending.get(key) is future:
                del self._pending[key]

    def _wait_pending(self, key: str) -> None:
        """Wait for the asynchronous write of ``key`` in flight, if any."""
        with self._pending_lock:
            future = self._pending.get(key)
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Wait for every asynchronous write asked for so far; raises the first error."""
        with self._pending_lock:
            futures = list(self._pending.values())
        for f in futures:
            f.result()

    def reconfigure(
        self,
        *,
        block_size: int | None = None,
        queue_depth: int | None = None,
        thread_count: int | None = None,
    ) -> None:
        """Serve later requests with new I/O settings (None: keep that one).

        A new backend and new request threads are started and swapped in; every request asked
        for before the call finishes on the old ones, which are then stopped (so this waits for
        the requests in flight). No other thread may start requests on this store meanwhile (the
        engine calls it between steps, with nothing of its own in flight). Bad values raise
        ``ValueError`` before anything changes."""
        self._check_open()
        bs = self.block_size if block_size is None else block_size
        qd = self.queue_depth if queue_depth is None else queue_depth
        tc = self.thread_count if thread_count is None else thread_count
        for name, value in (("block_size", bs), ("queue_depth", qd), ("thread_count", tc)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if bs % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN}, got {bs}")
        if (bs, qd, tc) == (self.block_size, self.queue_depth, self.thread_count):
            return
        backend = ThreadPoolBackend(bs, qd, tc)
        requests = _request_threads(tc)
        old_backend, old_requests = self._backend, self._requests
        self._backend, self._requests = backend, requests  # requests asked for from now on
        self.block_size, self.queue_depth, self.thread_count = bs, qd, tc
        self._spares.per_length = max(2, tc) + 1
        old_requests.shutdown(wait=True)  # requests already asked for (some on the old backend)
        old_backend.close()

    @property
    def writes_in_flight(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def link_to(self, key: str, dest: str | os.PathLike, *, fsync_dir: bool = False) -> Path:
        """Make ``dest`` a copy of ``key``'s file (e.g. into a checkpoint), replacing ``dest``.

        A hard link where possible: safe because store files are only ever replaced, never
        modified in place, so a later write of ``key`` leaves ``dest`` with the old version.
        Across filesystems (EXDEV) or where links are refused, a checksummed copy.
        """
        self._check_open()
        self._wait_pending(key)
        src, dest = self.path(key), Path(dest)
        if not src.is_file():
            raise StorageError(f"cannot link key {key!r}: it has no file in {self.run_dir}")
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in (
                errno.EXDEV,
                errno.EPERM,
                errno.EMLINK,
                errno.ENOTSUP,
                errno.EOPNOTSUPP,
            ):
                raise StorageError(f"cannot link {src} to {dest}: {e.strerror}") from e
            copy_tensor_file(src, dest, fsync_dir=fsync_dir)  # another filesystem: copy
            return dest
        try:
            os.replace(tmp, dest)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot link {src} to {dest}: {e.strerror}") from e
        if fsync_dir:
            _fsync_dir(dest.parent)
        return dest

    # ----------------------------------------------------------------------------------------
    # Space and accounting

    def free_bytes(self) -> int:
        """Free bytes on the filesystem holding the run directory."""
        return shutil.disk_usage(self.run_dir).free

    def check_space(self, nbytes: int) -> None:
        """Raise ``StorageError`` unless ``nbytes`` more bytes fit on the filesystem."""
        free = self.free_bytes()
        if free < nbytes:
            raise StorageError(
                f"{self.run_dir} needs {_gib(nbytes)} free, has {_gib(free)}; free space or point "
                f"nvme_path elsewhere"
            )

    @property
    def staging_bytes_total(self) -> int:
        """Host memory held by the staging buffers (count it against the DRAM budget)."""
        return self._staging.total_bytes

    def _account(self, op: str, key: str, nbytes: int, ticket) -> None:
        seconds, concurrency = self._inflight.leave(ticket)
        with self._counter_lock:
            if op == "read":
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
        if self.listener is not None:
            self.listener(op, key, nbytes, seconds, concurrency)

    # ----------------------------------------------------------------------------------------
    # Lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeStore at {self.run_dir} is closed")

    def close(self, remove: bool = True) -> None:
        """Finish pending async requests, stop the I/O threads, release the lock and (with
        ``remove``) delete the run directory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._requests.shutdown(wait=True)
        self._backend.close()
        if remove:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the fd drops the flock
            self._lock_fd = None

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NvmeStore({str(self.run_dir)!r}, o_direct={self.o_direct})"
