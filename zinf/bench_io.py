"""``zinf bench-io``: measure the NVMe path's throughput for each ``aio`` setting, next to a raw
baseline of the same disk, and recommend the best setting.

What is measured is zinf's real swap path: an :class:`~zinf.storage.nvme.NvmeStore` opened with
one ``(block_size, queue_depth, thread_count)`` per sweep point, writing and reading fp32 tensors
of shard-realistic sizes with ``write_async``/``read_async`` (as the engine's prefetch and
optimizer pipeline do), each write crash-safe (new version, ``fdatasync``, rename) and each read
checksummed. Per point:

* prepare: every key of the working set (``copies_per_size`` files of each size) is written once
  (fresh files; not timed), then one key of each size is overwritten (not timed), so that the
  store's spare-file pool is in its steady state;
* ``write``: ``rounds`` overwrites of the whole working set - what training does every step;
* ``read``: ``rounds`` reads of the whole working set into preallocated aligned buffers.

The raw baseline does the same bytes, file sizes and durability work with a plain tool, single
threaded, one file at a time: every file overwritten in place and flushed with ``fdatasync``
(zinf flushes each shard file with ``fdatasync`` and does not sync the directory), then read. The
tool is ``fio`` where installed, else ``dd``, else a Python loop of ``os.pwritev``/``os.preadv``
on an ``O_DIRECT`` descriptor. It runs once before and once after the sweep; the two passes are
pooled (and both kept, so drift during the run shows).

Where the filesystem refuses ``O_DIRECT`` (tmpfs before Linux 6.6, ramfs, some FUSE), both sides
use buffered I/O and the report says so: reads then come from the page cache and say little about
the disk.

Nothing here imports the profiler; :meth:`BenchReport.calibration_rows` gives plain dicts that the
CLI hands to :func:`profiler.calibrations.save_calibrations`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zinf.config import parse_size
from zinf.errors import ConfigError, StorageError
from zinf.storage.aligned import ALIGN, aligned_empty
from zinf.storage.fsinfo import O_DIRECT, filesystem_of, probe_o_direct
from zinf.storage.nvme import NvmeStore

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# The sweep. The default point of zinf's config (AioConfig: 1 MiB, 8, 4) and the seed article's
# recommendation (1 MiB, 32, 4) are both on the grid.
DEFAULT_SIZES_BYTES = (1 * MiB, 4 * MiB, 8 * MiB, 32 * MiB)
DEFAULT_BLOCK_SIZES_BYTES = (256 * KiB, 1 * MiB, 4 * MiB)
DEFAULT_THREAD_COUNTS = (1, 4, 8)
DEFAULT_QUEUE_DEPTHS = (8, 32)
DEFAULT_BYTES_PER_OP = 256 * MiB  # per point and direction: 18 points x 2 ops x 256 MiB ~ 9 GB

QUICK_SIZES_BYTES = (1 * MiB, 4 * MiB)
QUICK_BLOCK_SIZES_BYTES = (256 * KiB, 1 * MiB)
QUICK_THREAD_COUNTS = (1, 4)
QUICK_QUEUE_DEPTHS = (8,)
QUICK_BYTES_PER_OP = 16 * MiB

COPIES_PER_SIZE = 2  # files of each size in the working set; more in flight, more disk used
RAW_BLOCK_BYTES = 1 * MiB  # request size of the raw baselines (dd's and fio's bs)
MIN_FILE_BYTES = 4 * KiB
MAX_FILE_BYTES = 1 * GiB
NEAR_BEST_FRACTION = 0.05  # points within 5% of the best are reported as "as good, within noise"

ProgressFn = Callable[[int, int, str], None]  # (steps done, steps in all, what comes next)


# ------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class AioSetting:
    """One point of the sweep: the three knobs of DeepSpeed's (and zinf's) ``"aio"`` section."""

    block_size_bytes: int
    queue_depth: int
    thread_count: int

    def as_deepspeed(self) -> dict:
        """The ``"aio"`` section that selects this setting, in DeepSpeed's spelling."""
        return {
            "block_size": self.block_size_bytes,
            "queue_depth": self.queue_depth,
            "thread_count": self.thread_count,
            "single_submit": False,
            "overlap_events": True,
        }

    @property
    def label(self) -> str:
        return f"block {format_bytes(self.block_size_bytes)}, qd {self.queue_depth}, {self.thread_count} threads"


@dataclass(frozen=True)
class Throughput:
    """Bytes moved in one direction and the wall seconds it took."""

    bytes: int
    seconds: float

    @property
    def GBps(self) -> float:
        """10^9 bytes per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def __add__(self, other: Throughput) -> Throughput:
        return Throughput(self.bytes + other.bytes, self.seconds + other.seconds)


@dataclass(frozen=True)
class PointResult:
    """zinf's throughput at one :class:`AioSetting`."""

    setting: AioSetting
    read: Throughput
    write: Throughput

    @property
    def combined_GBps(self) -> float:
        """The recommendation's criterion: bytes read plus bytes written over the seconds of both.

        A training step reads and writes about the same bytes, so this is the throughput of a
        step's I/O; for equal bytes it is the harmonic mean of the two rates, so a setting
        cannot win on one direction while it is poor at the other."""
        return (self.read.bytes + self.write.bytes) / (self.read.seconds + self.write.seconds) / 1e9


@dataclass(frozen=True)
class BaselineResult:
    """The raw baseline: one tool, single-threaded, ``block_size_bytes`` requests. ``passes``
    holds each pass's (read, write) so drift over the run can be seen; ``read``/``write`` pool
    them."""

    method: str  # "fio", "dd" or "python"
    block_size_bytes: int
    passes: tuple[tuple[Throughput, Throughput], ...]

    @property
    def read(self) -> Throughput:
        return sum((r for r, _ in self.passes), Throughput(0, 0.0))

    @property
    def write(self) -> Throughput:
        return sum((w for _, w in self.passes), Throughput(0, 0.0))


@dataclass
class BenchReport:
    """Everything one ``bench-io`` run measured."""

    path: Path
    fstype: str
    o_direct: bool
    sizes_bytes: tuple[int, ...]
    copies_per_size: int
    rounds: int
    points: list[PointResult]
    baseline: BaselineResult
    created_at: float  # Unix epoch seconds, shared by all rows of the run
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def recommendation(self) -> PointResult:
        """The point with the highest :attr:`PointResult.combined_GBps`."""
        return max(self.points, key=lambda p: p.combined_GBps)

    def near_best(self) -> list[PointResult]:
        """Points other than the best whose combined throughput is within
        :data:`NEAR_BEST_FRACTION` of it: one run cannot tell these apart."""
        best = self.recommendation
        floor = best.combined_GBps * (1 - NEAR_BEST_FRACTION)
        return [p for p in self.points if p is not best and p.combined_GBps >= floor]

    def aio_snippet(self) -> str:
        """The recommended setting as a DeepSpeed-style ``"aio": {...}`` JSON fragment."""
        body = json.dumps(self.recommendation.setting.as_deepspeed(), indent=2)
        return '"aio": ' + body

    def calibration_rows(self) -> list[dict]:
        """Rows for the profile database's ``calibrations`` table: per point a ``read`` and a
        ``write`` row (``source`` "bench-io/zinf") with the baseline's GB/s beside them, then the
        baseline's own two rows (``source`` "bench-io/<tool>", ``raw_baseline_GBps`` empty).
        The table has no ``o_direct`` column: buffered runs append "/buffered" to ``source``."""
        suffix = "" if self.o_direct else "/buffered"
        common = {"created_at": self.created_at, "path": str(self.path), "fstype": self.fstype}
        rows = []
        for p in self.points:
            for op, tp, raw in (("read", p.read, self.baseline.read), ("write", p.write, self.baseline.write)):
                rows.append({
                    **common, "op": op, "block_size": p.setting.block_size_bytes,
                    "queue_depth": p.setting.queue_depth, "thread_count": p.setting.thread_count,
                    "bytes": tp.bytes, "GBps": tp.GBps, "raw_baseline_GBps": raw.GBps,
                    "source": f"bench-io/zinf{suffix}",
                })
        for op, tp in (("read", self.baseline.read), ("write", self.baseline.write)):
            rows.append({
                **common, "op": op, "block_size": self.baseline.block_size_bytes, "queue_depth": 1,
                "thread_count": 1, "bytes": tp.bytes, "GBps": tp.GBps, "raw_baseline_GBps": None,
                "source": f"bench-io/{self.baseline.method}{suffix}",
            })
        return rows


# ------------------------------------------------------------------------------------------------
# Input


def format_bytes(n_bytes: int) -> str:
    """``1048576`` -> ``"1MiB"``, ``262144`` -> ``"256KiB"`` (exact units only, else bytes)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n_bytes >= size and n_bytes % size == 0:
            return f"{n_bytes // size}{unit}"
    return f"{n_bytes}B"


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1MiB,4MiB,8MiB"`` -> byte counts. Each must be a multiple of 4 KiB between 4 KiB and
    1 GiB (O_DIRECT moves whole 4 KiB blocks). Raises :class:`ConfigError`."""
    sizes = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            n = parse_size(item)
        except ConfigError as e:
            raise ConfigError(f"--sizes: {e}") from None
        if n % ALIGN or not MIN_FILE_BYTES <= n <= MAX_FILE_BYTES:
            raise ConfigError(
                f"--sizes: {item!r} is {n} bytes; each size must be a multiple of 4KiB between "
                f"4KiB and 1GiB, e.g. --sizes 1MiB,4MiB,8MiB"
            )
        sizes.append(n)
    if not sizes:
        raise ConfigError(f"--sizes {text!r} names no size; give e.g. --sizes 1MiB,4MiB,8MiB")
    return tuple(dict.fromkeys(sizes))  # duplicates removed, order kept


def check_bench_dir(path: str | os.PathLike) -> Path:
    """``path`` as an absolute directory that exists and can be written; else
    :class:`StorageError` naming the problem and the fix. Unlike ``nvme_path`` it is never
    created: a typo must not benchmark the wrong disk."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    if not p.exists():
        raise StorageError(f"bench-io path {p} does not exist; create it, or pass the directory you will use as nvme_path")
    if not p.is_dir():
        raise StorageError(f"bench-io path {p} is a file, not a directory; pass a directory on the disk to measure")
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".zinf-bench-probe-"):
            pass
    except OSError as e:
        raise StorageError(f"bench-io path {p} is not writable ({e.strerror or e}); fix its permissions or pass a writable directory") from None
    return p


def default_grid(quick: bool = False) -> list[AioSetting]:
    """Block size x queue depth x thread count (the quick grid: 4 points for tests)."""
    blocks, depths, threads = (
        (QUICK_BLOCK_SIZES_BYTES, QUICK_QUEUE_DEPTHS, QUICK_THREAD_COUNTS) if quick
        else (DEFAULT_BLOCK_SIZES_BYTES, DEFAULT_QUEUE_DEPTHS, DEFAULT_THREAD_COUNTS)
    )
    return [AioSetting(b, q, t) for b in blocks for q in depths for t in threads]


# ------------------------------------------------------------------------------------------------
# The raw single-threaded loop (also used by zinf doctor and benchmarks/io_throughput.py)


def _fill_random(buf: torch.Tensor) -> None:
    """Random bytes, so that no layer below can compress or deduplicate them."""
    buf.view(torch.uint8)[:] = torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8)


def raw_write_file(
    path: Path, buf: torch.Tensor, *, o_direct: bool, fresh: bool, block_bytes: int = RAW_BLOCK_BYTES
) -> float:
    """Write all of ``buf`` (an aligned uint8 tensor) to ``path`` in ``block_bytes`` pieces with
    ``os.pwritev``, then ``fdatasync``. ``fresh`` creates the file (it must not exist); otherwise
    an existing file is overwritten in place. Returns wall seconds, open to close."""
    flags = os.O_WRONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0)
    if fresh:
        flags |= os.O_CREAT | os.O_EXCL
    view = memoryview(buf.numpy())
    start_s = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for offset in range(0, len(view), block_bytes):
            piece = view[offset : offset + block_bytes]
            done = 0
            while done < len(piece):
                done += os.pwritev(fd, [piece[done:]], offset + done)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start_s


def raw_read_file(path: Path, buf: torch.Tensor, *, o_direct: bool, block_bytes: int = RAW_BLOCK_BYTES) -> float:
    """Fill ``buf`` from the start of ``path`` in ``block_bytes`` pieces with ``os.preadv``.
    Returns wall seconds, open to close."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0)
    view = memoryview(buf.numpy())
    start_s = time.perf_counter()
    fd = os.open(path, flags)
    try:
        for offset in range(0, len(view), block_bytes):
            piece = view[offset : offset + block_bytes]
            done = 0
            while done < len(piece):
                n = os.preadv(fd, [piece[done:]], offset + done)
                if n == 0:
                    raise StorageError(f"{path} ended at {offset + done} bytes, expected {len(view)}")
                done += n
    finally:
        os.close(fd)
    return time.perf_counter() - start_s


# ------------------------------------------------------------------------------------------------
# Raw baselines: the same files, bytes and fdatasyncs through a plain tool


@dataclass(frozen=True)
class _Workload:
    """The files both sides move: ``copies`` files of each size, ``rounds`` times per op."""

    sizes_bytes: tuple[int, ...]
    copies: int
    rounds: int

    @property
    def working_set_bytes(self) -> int:
        return sum(self.sizes_bytes) * self.copies

    @property
    def bytes_per_op(self) -> int:
        return self.working_set_bytes * self.rounds

    def files(self) -> list[tuple[int, int]]:
        """(size index, copy) of every file of the working set, in a fixed order."""
        return [(i, c) for c in range(self.copies) for i in range(len(self.sizes_bytes))]


def _baseline_block_bytes(size_bytes: int) -> int:
    """The request size for a file: 1 MiB, or the largest divisor of it that keeps every
    request whole (the sizes are multiples of 4 KiB, so this is too)."""
    return math.gcd(size_bytes, RAW_BLOCK_BYTES)


def _python_baseline(work: Path, load: _Workload, o_direct: bool) -> tuple[Throughput, Throughput]:
    """(read, write) of the single-threaded ``os.preadv``/``os.pwritev`` loop."""
    bufs = [aligned_empty(s) for s in load.sizes_bytes]
    for b in bufs:
        _fill_random(b)
    paths = {f: work / f"raw-{f[0]}-{f[1]}.bin" for f in load.files()}
    for (i, _), p in paths.items():  # the files exist before the timed overwrites, as zinf's do
        raw_write_file(p, bufs[i], o_direct=o_direct, fresh=True, block_bytes=_baseline_block_bytes(load.sizes_bytes[i]))
    write_s = read_s = 0.0
    for _ in range(load.rounds):
        for (i, _), p in paths.items():
            write_s += raw_write_file(p, bufs[i], o_direct=o_direct, fresh=False,
                                      block_bytes=_baseline_block_bytes(load.sizes_bytes[i]))
    for _ in range(load.rounds):
        for (i, _), p in paths.items():
            read_s += raw_read_file(p, bufs[i], o_direct=o_direct, block_bytes=_baseline_block_bytes(load.sizes_bytes[i]))
    for p in paths.values():
        p.unlink()
    return Throughput(load.bytes_per_op, read_s), Throughput(load.bytes_per_op, write_s)


_DD_SECONDS = re.compile(r"copied, ([0-9.]+(?:e[-+]?[0-9]+)?) s")


def _dd(args: list[str]) -> float:
    """Run GNU dd and return the seconds it reports (its clock runs from the first request to
    after the final ``fdatasync``, without its own start-up)."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if done.returncode != 0:
        raise OSError(f"dd {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    match = _DD_SECONDS.search(done.stderr)
    if match is None:
        raise OSError(f"cannot read dd's timing from {done.stderr.strip()!r}")
    return float(match.group(1))


def _dd_baseline(work: Path, load: _Workload, o_direct: bool) -> tuple[Throughput, Throughput]:
    """(read, write) through ``dd``: each file overwritten with ``oflag=direct
    conv=notrunc,fdatasync`` from a cached source of random bytes, then read with
    ``iflag=direct``."""
    source = work / "dd-source.bin"
    source.write_bytes(os.urandom(max(load.sizes_bytes)))  # buffered: stays in the page cache
    oflag, iflag = (["oflag=direct"], ["iflag=direct"]) if o_direct else ([], [])
    paths = {f: work / f"dd-{f[0]}-{f[1]}.bin" for f in load.files()}

    def args(i: int) -> list[str]:
        bs = _baseline_block_bytes(load.sizes_bytes[i])
        return [f"bs={bs}", f"count={load.sizes_bytes[i] // bs}"]

    for (i, _), p in paths.items():
        _dd([f"if={source}", f"of={p}", *args(i), *oflag, "conv=fdatasync"])
    write_s = sum(_dd([f"if={source}", f"of={p}", *args(i), *oflag, "conv=notrunc,fdatasync"])
                  for _ in range(load.rounds) for (i, _), p in paths.items())
    read_s = sum(_dd([f"if={p}", "of=/dev/null", *args(i), *iflag])
                 for _ in range(load.rounds) for (i, _), p in paths.items())
    for p in [source, *paths.values()]:
        p.unlink()
    return Throughput(load.bytes_per_op, read_s), Throughput(load.bytes_per_op, write_s)


def _fio_jobfile(work: Path, load: _Workload, rw: str, o_direct: bool) -> str:
    """One job per size, run one after another (``stonewall``): ``copies`` files served in turn,
    ``rounds`` loops, psync at queue depth 1, an ``fdatasync`` after each file's worth of writes."""
    lines = ["[global]", "ioengine=psync", "iodepth=1", f"direct={int(o_direct)}", f"directory={work}",
             "file_service_type=sequential", f"loops={load.rounds}", "overwrite=1", "randrepeat=0",
             "refill_buffers=1", "stonewall"]
    for i, size in enumerate(load.sizes_bytes):
        bs = _baseline_block_bytes(size)
        lines += [f"[size{i}]", f"rw={rw}", f"bs={bs}", f"filesize={size}", f"nrfiles={load.copies}",
                  f"size={size * load.copies}", f"filename_format=fio-{i}.$filenum"]
        if rw == "write":
            lines.append(f"fdatasync={size // bs}")
    return "\n".join(lines) + "\n"


def _fio(work: Path, load: _Workload, rw: str, o_direct: bool) -> Throughput:
    jobfile = work / f"fio-{rw}.job"
    jobfile.write_text(_fio_jobfile(work, load, rw, o_direct))
    done = subprocess.run(["fio", "--output-format=json", str(jobfile)], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"fio failed: {(done.stderr or done.stdout).strip()[-300:]}")
    report = json.loads(done.stdout[done.stdout.index("{"):])  # fio may print notes before the JSON
    moved = Throughput(0, 0.0)
    for job in report["jobs"]:
        moved = moved + Throughput(int(job[rw]["io_bytes"]), job[rw]["runtime"] / 1000)  # runtime: ms
    return moved


def _fio_baseline(work: Path, load: _Workload, o_direct: bool) -> tuple[Throughput, Throughput]:
    """(read, write) through fio (``--direct=1``, psync, queue depth 1). fio lays the files out
    before the timed write job, so the timed writes are overwrites, as on the zinf side."""
    write = _fio(work, load, "write", o_direct)
    read = _fio(work, load, "read", o_direct)
    for p in work.glob("fio-*"):
        p.unlink()
    return read, write


_BASELINES = {"fio": _fio_baseline, "dd": _dd_baseline, "python": _python_baseline}


def _dd_usable(work: Path, o_direct: bool) -> bool:
    """Whether ``dd`` is GNU dd and reports its timing here (one 4 KiB write and read)."""
    probe = work / "dd-probe.bin"
    try:
        flag = ["oflag=direct"] if o_direct else []
        _dd(["if=/dev/zero", f"of={probe}", "bs=4096", "count=1", *flag, "conv=fdatasync"])
        _dd([f"if={probe}", "of=/dev/null", "bs=4096", *(["iflag=direct"] if o_direct else [])])
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def choose_baseline(work: Path, o_direct: bool) -> str:
    """The raw tool to use: "fio" if installed, else "dd" if it works here, else "python"."""
    if shutil.which("fio"):
        return "fio"
    if shutil.which("dd") and _dd_usable(work, o_direct):
        return "dd"
    return "python"


def measure_baseline(method: str, work: Path, load: _Workload, o_direct: bool) -> tuple[Throughput, Throughput]:
    """One pass of the raw baseline with ``method`` ("fio", "dd" or "python"): (read, write)."""
    return _BASELINES[method](work, load, o_direct)


# ------------------------------------------------------------------------------------------------
# zinf's side


def spare_bytes_like_engine(largest_file_bytes: int, swap_bytes: int) -> int:
    """The disk the engine gives its store for retired files (``Engine._spare_bytes``): room for
    four of the largest, or a quarter of the swap state up to 256 MiB, whichever is more."""
    return max(4 * largest_file_bytes, min(256 * MiB, swap_bytes // 4))


class _Tensors:
    """The fp32 tensors written (one per size, random values) and the aligned buffers the reads
    land in (one per file of the working set), allocated once for the whole run."""

    def __init__(self, load: _Workload) -> None:
        self.sources = []
        for size in load.sizes_bytes:
            t = aligned_empty(size).view(torch.float32)
            t.uniform_(-1, 1)
            self.sources.append(t)
        self.outs = {f: aligned_empty(load.sizes_bytes[f[0]]).view(torch.float32) for f in load.files()}
        for out in self.outs.values():
            out.zero_()  # touch every page now, so no page fault lands inside a timed read


def _key(f: tuple[int, int]) -> str:
    return f"bench/size{f[0]}/copy{f[1]}"


def measure_point(work: Path, setting: AioSetting, load: _Workload, tensors: _Tensors) -> PointResult:
    """zinf's read and write throughput at ``setting`` (see the module docstring)."""
    files = load.files()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the O_DIRECT fallback warning is given once, by run_bench
        store = NvmeStore(
            work, run_name=f"bench-{uuid.uuid4().hex[:8]}", block_size=setting.block_size_bytes,
            queue_depth=setting.queue_depth, thread_count=setting.thread_count,
            spare_bytes=spare_bytes_like_engine(max(load.sizes_bytes), load.working_set_bytes),
        )
    try:
        for f in files:  # prepare: fresh files, then one overwrite per size to seed the spare pool
            store.write_async(_key(f), tensors.sources[f[0]])
        for f in files[: len(load.sizes_bytes)]:
            store.write_async(_key(f), tensors.sources[f[0]])
        store.flush()

        start_s = time.perf_counter()
        for _ in range(load.rounds):
            for f in files:
                store.write_async(_key(f), tensors.sources[f[0]])
            store.flush()
        write_s = time.perf_counter() - start_s

        start_s = time.perf_counter()
        for _ in range(load.rounds):
            futures = [store.read_async(_key(f), tensors.outs[f]) for f in files]
            for fut in futures:
                fut.result()
        read_s = time.perf_counter() - start_s
    finally:
        store.close()
    return PointResult(setting, Throughput(load.bytes_per_op, read_s), Throughput(load.bytes_per_op, write_s))


# ------------------------------------------------------------------------------------------------
# The whole run


def plan_workload(sizes_bytes: Sequence[int], bytes_per_op: int, copies: int = COPIES_PER_SIZE) -> _Workload:
    """Enough rounds over ``copies`` files of each size to move at least ``bytes_per_op`` bytes
    per direction (one round at least)."""
    sizes = tuple(sizes_bytes)
    working_set = sum(sizes) * copies
    return _Workload(sizes, copies, max(1, math.ceil(bytes_per_op / working_set)))


def run_bench(
    path: str | os.PathLike,
    *,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    settings: Iterable[AioSetting] | None = None,
    bytes_per_op: int = DEFAULT_BYTES_PER_OP,
    baseline: str | None = None,
    progress: ProgressFn | None = None,
    warn: Callable[[str], None] | None = None,
) -> BenchReport:
    """Sweep ``settings`` (default: :func:`default_grid`) on ``path`` and measure the raw
    baseline (``baseline``: "fio", "dd", "python", or None to choose) before and after.

    Works in a private subdirectory of ``path`` that is removed at the end, also on error or
    interrupt. ``progress(done, total, next_label)`` is called before each step and once at the
    end; ``warn(message)`` for conditions the user must see (default: :func:`warnings.warn`).
    """
    root = check_bench_dir(path)
    settings = list(settings) if settings is not None else default_grid()
    if not settings:
        raise ConfigError("bench-io needs at least one aio setting to measure")
    load = plan_workload(sizes_bytes, bytes_per_op)
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
    usage = shutil.disk_usage(root)
    need_bytes = 3 * load.working_set_bytes + 64 * MiB  # working set, spares, temporaries, margin
    if usage.total > 0 and usage.free < need_bytes:  # ramfs reports total 0: no limit to check
        raise StorageError(
            f"bench-io needs about {need_bytes / GiB:.2f} GiB free on {root}, has {usage.free / GiB:.2f} GiB; "
            f"free space or pass smaller --sizes"
        )

    started_s = time.perf_counter()
    created_at = time.time()
    work = root / f".zinf-bench-io-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    total = len(settings) + 2
    step = 0

    def advance(label: str) -> None:
        nonlocal step
        if progress is not None:
            progress(step, total, label)
        step += 1

    try:
        o_direct = probe_o_direct(work)
        fstype = filesystem_of(work).fstype
        notes = []
        if not o_direct:
            msg = (f"O_DIRECT is refused on {fstype} at {root}; measuring buffered I/O instead (reads come from "
                   f"the page cache, so they say little about the disk); point --path at an ext4 or xfs NVMe directory")
            warn(msg)
            notes.append(msg)
        method = baseline or choose_baseline(work, o_direct)
        tensors = _Tensors(load)

        advance(f"raw baseline ({method}), pass 1")
        first = measure_baseline(method, work, load, o_direct)
        points = []
        for s in settings:
            advance(f"zinf: {s.label}")
            points.append(measure_point(work, s, load, tensors))
        advance(f"raw baseline ({method}), pass 2")
        second = measure_baseline(method, work, load, o_direct)
        advance("done")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return BenchReport(
        path=root, fstype=fstype, o_direct=o_direct, sizes_bytes=load.sizes_bytes,
        copies_per_size=load.copies, rounds=load.rounds, points=points,
        baseline=BaselineResult(method, RAW_BLOCK_BYTES, (first, second)),
        created_at=created_at, elapsed_s=time.perf_counter() - started_s, notes=notes,
    )


# ------------------------------------------------------------------------------------------------
# Presentation (rich)


def results_table(report: BenchReport):
    """A rich Table: one row per setting, read and write GB/s, each also as a multiple of the
    raw baseline, and the combined criterion ("r+w": read plus written bytes over the seconds of
    both); the recommendation is marked "best", the baseline's row "raw <tool>"."""
    from rich.table import Table

    raw_r, raw_w = report.baseline.read.GBps, report.baseline.write.GBps
    best = report.recommendation
    mode = "O_DIRECT" if report.o_direct else "buffered"
    table = Table(title=f"zinf NVMe path on {report.path} ({report.fstype}, {mode})")
    for name in ("block", "qd", "threads", "read\nGB/s", "read\nx raw", "write\nGB/s", "write\nx raw", "r+w\nGB/s", ""):
        table.add_column(name, justify="right" if name else "left", no_wrap=True)
    for p in report.points:
        table.add_row(
            format_bytes(p.setting.block_size_bytes), str(p.setting.queue_depth), str(p.setting.thread_count),
            f"{p.read.GBps:.2f}", f"{p.read.GBps / raw_r:.2f}", f"{p.write.GBps:.2f}", f"{p.write.GBps / raw_w:.2f}",
            f"{p.combined_GBps:.2f}", "best" if p is best else "",
            style="bold green" if p is best else None,
        )
    b = report.baseline
    table.add_section()
    table.add_row(
        format_bytes(b.block_size_bytes), "1", "1", f"{raw_r:.2f}", "1.00", f"{raw_w:.2f}", "1.00",
        f"{(b.read.bytes + b.write.bytes) / (b.read.seconds + b.write.seconds) / 1e9:.2f}",
        f"raw {b.method}", style="dim",
    )
    return table


def summary_lines(report: BenchReport) -> list[str]:
    """What the run was, the baseline's two passes, and the recommendation, as plain lines."""
    sizes = ",".join(format_bytes(s) for s in report.sizes_bytes)
    per_op = report.points[0].read.bytes if report.points else 0
    passes = "; ".join(f"pass {i + 1}: read {r.GBps:.2f}, write {w.GBps:.2f} GB/s"
                       for i, (r, w) in enumerate(report.baseline.passes))
    best = report.recommendation
    lines = [
        f"files: {report.copies_per_size} of each of {sizes}, {report.rounds} rounds = "
        f"{format_bytes(per_op) if per_op % KiB == 0 else per_op} per point and direction; "
        f"every write fdatasync'ed, as zinf does; {report.elapsed_s:.1f} s in all",
        f"raw baseline ({report.baseline.method}, single-threaded, {format_bytes(report.baseline.block_size_bytes)} "
        f"requests): {passes}",
        f"best: {best.setting.label}: read {best.read.GBps:.2f} GB/s, write {best.write.GBps:.2f} GB/s "
        f"(criterion: read+write bytes over read+write seconds)",
    ]
    near = report.near_best()
    if near:
        lines.append(f"{len(near)} other setting(s) within {NEAR_BEST_FRACTION:.0%} of it, too close to tell apart "
                     f"in one run: " + "; ".join(p.setting.label for p in near))
    return lines
