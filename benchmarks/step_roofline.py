"""Step time of an NVMe-bound training configuration against its roofline (issue 3, 6b/6c).

One command::

    python benchmarks/step_roofline.py --path /work/tmp/bench [--rounds 3] [--steps 8]

measures, interleaved in one run (round after round, so that a noisy neighbour hits all alike):

* ``zinf``: the built-in GPT with params and optimizer state all on NVMe under a DRAM budget of
  ``--dram-fraction`` of its state (default half; it pays for the overlap buffers), prefetch and pipelining on (the defaults);
* ``zinf-sync``: the same with prefetch off (``stage3_prefetch_bucket_size: 0``), the optimizer
  pipeline off (``pipeline_read/pipeline_write: false``) and no updates during backward;
* ``compute``: the same model, batch and data in plain PyTorch with everything in DRAM
  (forward + backward + ``torch.optim.AdamW``): the compute floor;
* ``raw``: single-threaded O_DIRECT read and write throughput of the same path (8 MiB blocks
  over a 256 MiB file that is overwritten, never grown), the disk's floor.

The roofline of a step is ``max(compute_s, read_bytes / raw_read_Bps + write_bytes / raw_write_Bps)``
with the NVMe bytes that zinf's step really moved. It prints the medians and the ratios
step ÷ roofline for both zinf variants.
"""

from __future__ import annotations

import argparse
import copy
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zinf  # noqa: E402
from zinf.models import build_model  # noqa: E402
from zinf.models.data import TokenBatches, markov_tokens  # noqa: E402
from zinf.storage.fsinfo import filesystem_of  # noqa: E402


def raw_o_direct_GBps(path: Path, block_bytes: int = 8 << 20, total_bytes: int = 256 << 20) -> tuple[float, float]:
    """(read, write) GB/s of a plain single-threaded O_DIRECT loop overwriting one file."""
    path.mkdir(parents=True, exist_ok=True)
    f = path / "raw-baseline.bin"
    buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block_bytes))
    n = total_bytes // block_bytes
    fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        if os.fstat(fd).st_size < total_bytes:  # write it once so later writes overwrite
            for i in range(n):
                os.pwrite(fd, buf, i * block_bytes)
            os.fsync(fd)
        t0 = time.perf_counter()
        for i in range(n):
            os.pwrite(fd, buf, i * block_bytes)
        os.fdatasync(fd)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            os.preadv(fd, [buf], i * block_bytes)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    return total_bytes / read_s / 1e9, total_bytes / write_s / 1e9


def make_model(preset: str):
    torch.manual_seed(0)
    return build_model("gpt", preset)


def zinf_config(model, swap: Path, batch: int, overlap: bool, dram_fraction: float) -> dict:
    n = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(swap)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
            "stage3_prefetch_bucket_size": n // 4,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2},
        # state = fp32 param + grad + master + exp_avg + exp_avg_sq = 20 bytes per parameter
        "zinf": {"dram_budget": int(dram_fraction * 20 * n), "device": "cpu"},  # CPU compute, as the plain-PyTorch yardstick
    }
    if not overlap:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        cfg["zero_optimization"]["offload_optimizer"].update(pipeline_read=False, pipeline_write=False)
        cfg["zinf"]["overlap_optimizer"] = False
    return cfg


def run_zinf(model, data, swap: Path, batch: int, steps: int, overlap: bool, dram_fraction: float) -> dict:
    """Median step seconds (after two warm-up steps) and NVMe bytes per step."""
    times, read_b, written_b = [], [], []
    with zinf.initialize(copy.deepcopy(model), zinf_config(model, swap, batch, overlap, dram_fraction)) as engine:
        for step in range(steps):
            before_r, before_w = engine.traffic_total.read["nvme"], engine.traffic_total.written["nvme"]
            t0 = time.perf_counter()
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
            dt = time.perf_counter() - t0
            if step >= 2:
                times.append(dt)
                read_b.append(engine.traffic_total.read["nvme"] - before_r)
                written_b.append(engine.traffic_total.written["nvme"] - before_w)
        ov = engine.overlap
    return {"step_s": statistics.median(times), "read_bytes": statistics.median(read_b),
            "written_bytes": statistics.median(written_b), "overlap_bytes": ov.total_bytes,
            "overlap_on": [k for k, on in (("prefetch", ov.prefetch_bytes), ("read-ahead", ov.read_ahead_bytes),
                                            ("write-behind", ov.write_bytes), ("in-backward", ov.eager)) if on]}


def run_plain(model, data, steps: int) -> float:
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = data.get(step)
        m(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="directory on the disk to measure (swap files go here)")
    ap.add_argument("--preset", default="demo", help="built-in GPT size: tiny, small, demo")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (small: NVMe-bound)")
    ap.add_argument("--steps", type=int, default=8, help="steps per measurement (the first two are warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--dram-fraction", type=float, default=0.5,
                    help="zinf.dram_budget as a fraction of the training state (all state stays on NVMe; "
                         "the budget pays for prefetch and pipeline buffers)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model, mcfg = make_model(args.preset)
    data = TokenBatches(markov_tokens(mcfg.vocab_size, 100_000, seed=0), args.batch, mcfg.block_size, seed=0)
    swap = args.path / "swap"
    rows: dict[str, list] = {"zinf": [], "zinf-sync": [], "compute_s": [], "raw_read_GBps": [], "raw_write_GBps": []}
    for r in range(args.rounds):
        rows["zinf"].append(run_zinf(model, data, swap, args.batch, args.steps, overlap=True, dram_fraction=args.dram_fraction))
        rows["zinf-sync"].append(run_zinf(model, data, swap, args.batch, args.steps, overlap=False, dram_fraction=args.dram_fraction))
        rows["compute_s"].append(run_plain(model, data, args.steps))
        rd, wr = raw_o_direct_GBps(args.path)
        rows["raw_read_GBps"].append(rd)
        rows["raw_write_GBps"].append(wr)
        print(f"round {r + 1}/{args.rounds}: zinf {rows['zinf'][-1]['step_s']:.3f} s, sync {rows['zinf-sync'][-1]['step_s']:.3f} s, "
              f"compute {rows['compute_s'][-1]:.3f} s, raw read {rd:.2f} GB/s, write {wr:.2f} GB/s", flush=True)
    (args.path / "raw-baseline.bin").unlink(missing_ok=True)
    shutil.rmtree(swap, ignore_errors=True)

    med = statistics.median
    compute_s = med(rows["compute_s"])
    read_Bps, write_Bps = med(rows["raw_read_GBps"]) * 1e9, med(rows["raw_write_GBps"]) * 1e9
    n = sum(p.numel() for p in model.parameters())
    fs = filesystem_of(args.path)
    print(f"\n{time.strftime('%Y-%m-%d')} on {platform.node()} ({os.cpu_count()} cores), {fs.fstype} at {args.path}")
    print(f"GPT '{args.preset}' {n / 1e6:.1f} M params, batch {args.batch} x {mcfg.block_size}, all state on NVMe, "
          f"DRAM budget {args.dram_fraction * 20 * n / 2**20:.0f} MiB ({args.dram_fraction:.0%} of the state); raw O_DIRECT read {read_Bps / 1e9:.2f} GB/s, write {write_Bps / 1e9:.2f} GB/s; "
          f"compute (plain PyTorch in DRAM) {compute_s:.3f} s")
    result = {"compute_s": compute_s, "raw_read_GBps": read_Bps / 1e9, "raw_write_GBps": write_Bps / 1e9}
    print(f"{'variant':<10} {'step_s':>8} {'read_MB':>8} {'write_MB':>9} {'nvme_s':>7} {'roofline_s':>10} {'step/roofline':>14}")
    for name in ("zinf", "zinf-sync"):
        step_s = med(x["step_s"] for x in rows[name])
        rb = med(x["read_bytes"] for x in rows[name])
        wb = med(x["written_bytes"] for x in rows[name])
        nvme_s = rb / read_Bps + wb / write_Bps
        roof = max(compute_s, nvme_s)
        result[name] = {"step_s": step_s, "read_bytes": rb, "written_bytes": wb, "nvme_s": nvme_s, "roofline_s": roof, "ratio": step_s / roof}
        on = ", ".join(rows[name][0]["overlap_on"]) or "none"
        print(f"{name:<10} {step_s:8.3f} {rb / 1e6:8.0f} {wb / 1e6:9.0f} {nvme_s:7.3f} {roof:10.3f} {step_s / roof:14.2f}   overlap: {on}")
    print(f"prefetch + pipelining buy {result['zinf-sync']['step_s'] / result['zinf']['step_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows, "summary": result}, indent=1))


if __name__ == "__main__":
    main()
