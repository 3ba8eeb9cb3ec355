"""zinf's NVMe read/write throughput per shard size against a raw O_DIRECT loop on the same path.

One command::

    .venv/bin/python benchmarks/io_throughput.py --path /work/tmp/bench [--repeats 5] [--mib-per-size 256] [--profile]

For each shard size (1, 2, 4, 8 MiB) and each of three operations it measures, interleaved
within every repeat (raw, zinf, raw, zinf, ...; the one that goes first alternates between
repeats, so neither always meets a cold or a warm disk):

* ``fresh``: writing keys that do not exist yet (the engine's first write of every shard).
  zinf: ``NvmeStore.write`` of new keys (temporary file, ``posix_fallocate``, payload, header,
  ``fdatasync``, rename). raw: create a new file with ``O_DIRECT``, write it in 1 MiB pieces,
  ``fdatasync``.
* ``overwrite``: writing new versions of existing keys (what training does every step). zinf:
  ``NvmeStore.write`` of existing keys (with its spare-file pool: the new version overwrites a
  retired file of the same length, then the names are exchanged). raw: overwrite an existing file
  of the same size in place with ``O_DIRECT``, ``fdatasync``.
* ``read``: zinf: ``NvmeStore.read`` into a preallocated aligned fp32 tensor (CRC-32 checked).
  raw: ``O_DIRECT`` read of the whole file into an aligned buffer in 1 MiB pieces.

zinf runs with the engine's default ``aio`` settings (``zinf.config.AioConfig()``) and staging
buffers, one synchronous call at a time like the raw loop. Each repeat moves ``--mib-per-size``
MiB per size, operation and side, over distinct files. Throughput counts payload bytes only
(zinf's 4 KiB header is its own overhead). Printed per size and operation: the median GB/s of
each side over the repeats and the ratio zinf / raw of the medians; last, the smallest ratio.

``--profile`` also runs zinf's writes and reads once more per size with timers wrapped around the
steps of :func:`zinf.storage.shardfile.write_tensor_file` and ``read_tensor_file`` (open,
preallocate, payload transfer, CRC combine, header, fdatasync, rename/exchange, close), and
prints where the time goes. It wraps module attributes at run time; zinf's files are not changed.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zinf.bench_io import check_bench_dir, raw_read_file, raw_write_file, spare_bytes_like_engine  # noqa: E402
from zinf.config import AioConfig, ZinfConfig  # noqa: E402
from zinf.storage.aligned import aligned_empty  # noqa: E402
from zinf.storage.fsinfo import filesystem_of, probe_o_direct  # noqa: E402
from zinf.storage.nvme import NvmeStore  # noqa: E402

MiB = 1 << 20
SIZES_BYTES = (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB)
# "...+async": zinf as the engine drives it (write_async/read_async, up to thread_count files in
# flight: the optimizer pipeline's write-behind and the prefetcher's read-ahead); the raw side is
# the same single-threaded loop as for the synchronous op.
OPS = ("fresh", "overwrite", "read", "overwrite+async", "read+async")


class Bench:
    """The files and tensors of one shard size, for both sides."""

    def __init__(self, work: Path, size_bytes: int, files: int, store: NvmeStore, fresh_store: NvmeStore,
                 o_direct: bool) -> None:
        self.size_bytes = size_bytes
        self.files = files
        self.o_direct = o_direct
        self.store, self.fresh_store = store, fresh_store
        self.raw_dir = work / f"raw-{size_bytes}"
        self.raw_dir.mkdir()
        self.buf = aligned_empty(size_bytes)  # raw side: page-aligned, as O_DIRECT needs
        self.buf[:] = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8)
        self.tensor = aligned_empty(size_bytes).view(torch.float32)  # zinf side: fp32, like a shard
        self.tensor.uniform_(-1, 1)
        self.out = aligned_empty(size_bytes).view(torch.float32)
        self.out.zero_()
        self.outs = [aligned_empty(size_bytes).view(torch.float32) for _ in range(store.thread_count)]
        self.repeat = 0
        # existing files for overwrite and read, written once (not timed)
        for i in range(files):
            raw_write_file(self._raw(i), self.buf, o_direct=o_direct, fresh=True)
            store.write(self._key(i), self.tensor)
        store.write(self._key(0), self.tensor)  # retire one version: the spare pool's steady state

    def _raw(self, i: int) -> Path:
        return self.raw_dir / f"{i}.bin"

    def _key(self, i: int) -> str:
        return f"size{self.size_bytes}/{i}"

    def run(self, side: str, op: str) -> float:
        """Seconds for ``files`` operations ``op`` on ``side`` ("raw" or "zinf")."""
        start_s = time.perf_counter()
        if side == "raw":
            op = op.removesuffix("+async")
            if op == "fresh":
                for i in range(self.files):
                    raw_write_file(self.raw_dir / f"fresh-{i}.bin", self.buf, o_direct=self.o_direct, fresh=True)
            elif op == "overwrite":
                for i in range(self.files):
                    raw_write_file(self._raw(i), self.buf, o_direct=self.o_direct, fresh=False)
            else:
                for i in range(self.files):
                    raw_read_file(self._raw(i), self.buf, o_direct=self.o_direct)
        else:
            if op == "fresh":
                for i in range(self.files):
                    self.fresh_store.write(f"fresh{self.size_bytes}/{self.repeat}/{i}", self.tensor)
            elif op == "overwrite":
                for i in range(self.files):
                    self.store.write(self._key(i), self.tensor)
            elif op == "read":
                for i in range(self.files):
                    self.store.read(self._key(i), out=self.out)
            else:
                self._run_async(op)
        elapsed_s = time.perf_counter() - start_s
        if op == "fresh":
            self._remove_fresh(side)
        return elapsed_s

    def _run_async(self, op: str) -> None:
        """``files`` writes or reads with up to ``thread_count`` in flight, oldest waited first."""
        depth = len(self.outs)
        in_flight = []
        for i in range(self.files):
            if len(in_flight) == depth:
                in_flight.pop(0).result()
            if op == "overwrite+async":
                in_flight.append(self.store.write_async(self._key(i), self.tensor))
            else:
                in_flight.append(self.store.read_async(self._key(i), out=self.outs[i % depth]))
        for f in in_flight:
            f.result()

    def _remove_fresh(self, side: str) -> None:
        """Delete what a fresh-write run made (not timed), so the next run writes new files again.
        The fresh store keeps no spares, so its deletes unlink the files."""
        if side == "raw":
            for i in range(self.files):
                (self.raw_dir / f"fresh-{i}.bin").unlink()
        else:
            for i in range(self.files):
                self.fresh_store.delete(f"fresh{self.size_bytes}/{self.repeat}/{i}")


# ------------------------------------------------------------------------------------------------
# --profile: timers around the steps of write_tensor_file / read_tensor_file


@contextmanager
def step_timers():
    """Wrap the functions write_tensor_file and read_tensor_file call, to add up seconds per step.
    Yields the {step: seconds} dict; restores everything on exit."""
    from zinf.storage import shardfile

    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    patched = []

    def wrap(owner, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:  # the storage code changed: profile what is still there
            return

        def timed(*args, **kwargs):
            start_s = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start_s
                calls[label] += 1

        patched.append((owner, attr, original))
        setattr(owner, attr, timed)

    # shardfile imported these names, or calls them through the os module
    wrap(shardfile.os, "open", "open")
    wrap(shardfile.os, "close", "close")
    wrap(shardfile.os, "fdatasync", "fdatasync")
    wrap(shardfile.os, "fstat", "fstat")
    wrap(shardfile.os, "replace", "rename (os.replace)")
    wrap(shardfile, "_preallocate", "posix_fallocate")
    wrap(shardfile, "_write_header", "header write")
    wrap(shardfile, "_read_header_fd", "header read")
    wrap(shardfile, "exchange_names", "renameat2 exchange")
    wrap(shardfile._CrcParts, "combine", "crc32 combine")
    wrap(shardfile._Transfer, "run", "payload transfer (+crc on workers)")
    wrap(shardfile, "aligned_empty", "aligned_empty (bounce/header buffers)")
    # runs on the I/O workers, inside "payload transfer"; pieces of one file may overlap
    wrap(shardfile, "payload_crc32", "crc32 of pieces (worker threads)")
    try:
        yield seconds, calls
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


def profile(b: Bench, report) -> None:
    """Per step seconds of one pass of zinf's overwrite, fresh write and read, per file."""
    for op in ("overwrite", "fresh", "read"):
        with step_timers() as (seconds, calls):
            total_s = b.run("zinf", op)
        b.repeat += 1
        per_file_ms = total_s / b.files * 1e3
        report(f"  {op:9s} {b.size_bytes // MiB} MiB: {per_file_ms:.3f} ms per file "
               f"({b.size_bytes / (total_s / b.files) / 1e9:.2f} GB/s)")
        for label, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            report(f"      {label:40s} {s / b.files * 1e3:8.3f} ms/file  {s / total_s:6.1%}  ({calls[label] / b.files:g} calls/file)")


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="directory on the disk to measure (must exist)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats (at least 5 for the medians)")
    ap.add_argument("--mib-per-size", type=int, default=256, help="MiB each side moves per size, op and repeat")
    ap.add_argument("--profile", action="store_true", help="also print where zinf's time goes, per step")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    args = ap.parse_args()
    ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        sys.exit(f"io_throughput: unknown --ops {','.join(unknown) or '(none)'}; choose from {','.join(OPS)}")

    root = check_bench_dir(args.path)
    work = root / f".io-throughput-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    aio, zcfg = AioConfig(), ZinfConfig()
    o_direct = probe_o_direct(work)
    fs = filesystem_of(work)
    print(f"path {root} ({fs.fstype} on {fs.device}), O_DIRECT {'on' if o_direct else 'REFUSED: buffered'}; "
          f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"zinf: NvmeStore with the engine's defaults: block_size {aio.block_size}, queue_depth {aio.queue_depth}, "
          f"thread_count {aio.thread_count}, staging {zcfg.staging_buffers} x {zcfg.staging_buffer_size} bytes")
    print(f"raw: single-threaded os.pwritev/os.preadv, 1 MiB pieces, fdatasync per file; "
          f"{args.repeats} repeats x {args.mib_per_size} MiB per size, op and side, interleaved")
    total_bytes = len(SIZES_BYTES) * args.mib_per_size * MiB
    store = NvmeStore(work, run_name="overwrite", block_size=aio.block_size, queue_depth=aio.queue_depth,
                      thread_count=aio.thread_count, staging_bytes=zcfg.staging_buffer_size,
                      staging_count=zcfg.staging_buffers,
                      spare_bytes=spare_bytes_like_engine(max(SIZES_BYTES), total_bytes))
    fresh_store = NvmeStore(work, run_name="fresh", block_size=aio.block_size, queue_depth=aio.queue_depth,
                            thread_count=aio.thread_count, staging_bytes=zcfg.staging_buffer_size,
                            staging_count=zcfg.staging_buffers, spare_bytes=0)
    GBps: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    try:
        benches = [Bench(work, s, args.mib_per_size * MiB // s, store, fresh_store, o_direct) for s in SIZES_BYTES]
        start_s = time.perf_counter()
        for rep in range(args.repeats):
            order = ("raw", "zinf") if rep % 2 == 0 else ("zinf", "raw")
            for b in benches:
                b.repeat = rep
                for op in ops:
                    for side in order:
                        GBps[(b.size_bytes, op, side)].append(b.files * b.size_bytes / b.run(side, op) / 1e9)
        elapsed_s = time.perf_counter() - start_s

        print()
        # zinf/raw: ratio of the medians; pairs: median of the ratios of the runs of one repeat,
        # which ran back to back, so a disk that drifts over the minutes cancels out.
        print(f"{'size':>6} {'op':>15} {'raw GB/s':>9} {'zinf GB/s':>10} {'zinf/raw':>9} {'pairs':>6}"
              f"   raw (each repeat) | zinf (each repeat)")
        ratios = {}
        for b in benches:
            for op in ops:
                raw, zinf = GBps[(b.size_bytes, op, "raw")], GBps[(b.size_bytes, op, "zinf")]
                ratio = statistics.median(zinf) / statistics.median(raw)
                pairs = statistics.median(z / r for z, r in zip(zinf, raw))
                ratios[(b.size_bytes, op)] = ratio
                print(f"{b.size_bytes // MiB:>4}MiB {op:>15} {statistics.median(raw):>9.2f} {statistics.median(zinf):>10.2f} "
                      f"{ratio:>9.2f} {pairs:>6.2f}   {' '.join(f'{x:.2f}' for x in raw)} | {' '.join(f'{x:.2f}' for x in zinf)}")
        worst = min(ratios, key=ratios.get)
        print(f"min ratio zinf/raw: {ratios[worst]:.2f} ({worst[0] // MiB} MiB {worst[1]}); {elapsed_s:.0f} s of measurement")

        if args.profile:
            print("\nprofile (one more pass of each zinf op; time per file by step of write_tensor_file/read_tensor_file;"
                  " steps nest: the transfer and header happen between open and close)")
            for b in benches:
                b.repeat = args.repeats  # fresh keys not used before
                profile(b, print)
    finally:
        store.close()
        fresh_store.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
