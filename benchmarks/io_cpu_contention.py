"""How much CPU compute the NVMe store's reads take from the training thread on this machine.

On a CPU compute device the store's request threads run on the cores the training thread's
torch kernels run on. This measures it side by side in one run with the planner's own
:func:`planner.workload.measure_io_cpu` (what the adaptive controller runs once per run on a CPU
device): a torch matmul loop timed alone, then while the store reads 1 MiB shard files back to
back on its request threads (O_DIRECT where the filesystem allows it, as the engine reads). It
prints the slowdown ratio and the compute lost per MB read, the number the simulator charges
per NVMe byte (``Workload.io_cpu_s_per_byte``).

    python3 benchmarks/io_cpu_contention.py --path /tmp/ioc
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planner.workload import measure_io_cpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", type=Path, required=True, help="directory on the disk to read from (files removed at the end)")
    ap.add_argument("--seconds", type=float, default=0.5, help="length of one timing of the compute loop")
    ap.add_argument("--repeats", type=int, default=3, help="timings per condition; the fastest counts")
    ap.add_argument("--threads", type=int, default=4, help="the store's request threads (the engine's aio.thread_count)")
    args = ap.parse_args()
    args.path.mkdir(parents=True, exist_ok=True)
    t = measure_io_cpu(args.path, thread_count=args.threads, target_s=args.seconds, repeats=args.repeats)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), store threads {args.threads}")
    print(f"compute alone {t.alone_s * 1e3:.0f} ms; beside reads at {t.read_Bps / 1e6:.0f} MB/s {t.beside_s * 1e3:.0f} ms: "
          f"{t.beside_s / t.alone_s:.2f}x; compute lost per MB read {t.s_per_byte * 1e9:.3f} ms")


if __name__ == "__main__":
    main()
