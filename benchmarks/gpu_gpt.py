"""zinf on a GPU: step time of the benchmark GPT (benchmarks/gpu_model.py, 368 M parameters, bf16,
batch 8 x 512) in several placements, against plain PyTorch with everything on the GPU and the
step's roofline, all measured in one run on the same machine.

    python benchmarks/gpu_gpt.py --path /tmp/zinf-bench --configs plain,compute,zinf:1,zinf:0.5,zinf:0

Configs:

* ``plain``: plain PyTorch, everything on the GPU (bf16 working copy, fp32 masters, fused AdamW
  on the GPU): the speed zinf gives up and the GPU memory it saves (the seed's headline claim);
* ``compute``: plain PyTorch forward + backward only, on the GPU: the compute floor;
* ``zinf:F``: zinf with a fraction F of the model's training state in DRAM (1: params and
  optimizer state in pinned DRAM; 0: all on NVMe; between: the first blocks wholly in DRAM by
  ``module_parameters`` pins, the rest on NVMe).

Raw floors measured beside them: O_DIRECT read and write of the swap directory's disk (over
``--raw-gib``, 4 GiB: a step moves several GB, and a cloud disk is slower over that than over a
256 MiB burst, which is printed too), a
pinned host -> device copy, and one fused AdamW update of all the model's fp32 masters on the CPU
(torch's own kernel on one flat tensor: the optimizer of an offloaded model runs on the CPU
every step, in zinf as in DeepSpeed). The roofline of a zinf step is
``max(compute, disk, H2D bytes / raw H2D, CPU AdamW)`` with the bytes zinf's step really moved,
where ``disk`` is the faster of moving the step's NVMe bytes one direction after the other
(read bytes / raw read + write bytes / raw write) and moving them at once (measured after each
config: ``--raw-threads`` (8) readers and as many writers of 8 MiB O_DIRECT requests on the same
bytes, scaled from at most 4 GiB). Prints one JSON line per config and a summary table.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zinf  # noqa: E402
from gpu_model import GPT, batch, cuda_seconds, train_step  # noqa: E402
from step_roofline import raw_o_direct_GBps  # noqa: E402
from zinf.hardware import rss_bytes  # noqa: E402



def raw_h2d_GBps(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    _, seconds = cuda_seconds(lambda: [dst.copy_(src, non_blocking=True) for _ in range(10)])
    return 10 * nbytes / seconds / 1e9


def raw_mixed_io_s(path: Path, read_bytes: int, write_bytes: int, threads: int = 4,
                   block_bytes: int = 8 << 20, cap_bytes: int = 4 << 30) -> float:
    """Seconds for the disk to read ``read_bytes`` and write ``write_bytes`` at the same time,
    as a step does: ``threads`` readers and ``threads`` writers of ``block_bytes`` O_DIRECT
    requests, on pre-written files (writes overwrite, then fdatasync). Scaled from a run of at
    most ``cap_bytes`` in the same read:write proportion."""
    scale = min(1.0, cap_bytes / max(1, read_bytes + write_bytes))
    n_read, n_write = (max(1, int(b * scale) // block_bytes) for b in (read_bytes, write_bytes))
    files = {"r": (path / "raw-mixed-read.bin", n_read), "w": (path / "raw-mixed-write.bin", n_write)}
    fds = {}
    buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block_bytes))
    for key, (f, n) in files.items():  # write both once, untimed
        fd = fds[key] = os.open(f, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        for i in range(n):
            os.pwrite(fd, buf, i * block_bytes)
        os.fsync(fd)

    def work(op: str, blocks: range) -> None:
        own = mmap.mmap(-1, block_bytes)
        own.write(bytes(buf))
        for i in blocks:
            if op == "r":
                os.preadv(fds["r"], [own], i * block_bytes)
            else:
                os.pwrite(fds["w"], own, i * block_bytes)

    jobs = [("r", range(k, n_read, threads)) for k in range(threads)] + [("w", range(k, n_write, threads)) for k in range(threads)]
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda job: work(*job), jobs))
            os.fdatasync(fds["w"])
            seconds = time.perf_counter() - t0
    finally:
        for key, (f, _) in files.items():
            os.close(fds[key])
            f.unlink(missing_ok=True)
    return seconds * (read_bytes + write_bytes) / ((n_read + n_write) * block_bytes)


def raw_cpu_adamw_s(n_params: int, repeats: int = 3) -> float:
    """Seconds of one fused AdamW step over ``n_params`` fp32 parameters on the CPU (median)."""
    from torch.optim.adamw import adamw

    p, g, m, v = (torch.full((n_params,), 0.01) for _ in range(4))
    times = []
    for i in range(repeats + 1):  # the first one warms the pages and the kernel
        t0 = time.perf_counter()
        adamw([p], [g], [m], [v], [], [torch.tensor(float(i))], fused=True, amsgrad=False, beta1=0.9,
              beta2=0.999, lr=1e-4, weight_decay=0.01, eps=1e-8, maximize=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def build(args) -> GPT:
    torch.manual_seed(0)
    return GPT(args.d, args.layers)


def run_plain(args, optimizer: bool) -> dict:
    master = build(args).cuda()
    work = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-4, fused=True) if optimizer else None

    def one_step(x, y):
        loss = work(x, y)
        loss.backward()
        if opt is not None:
            for p32, p in zip(master.parameters(), work.parameters()):
                p32.grad = p.grad.float()
                p.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p32, p in zip(master.parameters(), work.parameters()):
                    p.copy_(p32)
        else:
            for p in work.parameters():
                p.grad = None
        return loss

    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps):
        x, y = batch(step, args.batch, "cuda")
        loss, seconds = cuda_seconds(lambda: one_step(x, y))
        times.append(seconds)
    out = {"step_s": times, "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item()}
    del master, work, opt
    torch.cuda.empty_cache()
    return out


def zinf_config(args, fraction: float, n_params: int, block_params: int) -> dict:
    nvme = str(Path(args.path) / "swap")
    if fraction >= 1:
        off = {"device": "cpu", "pin_memory": True}
        zero = {"offload_param": off, "offload_optimizer": dict(off)}
    else:
        pins = {}
        # whole blocks in DRAM, first in model order, as many as the fraction of the state allows
        k = int(fraction * n_params // block_params)
        if k > 0:
            pins = {f"blocks[0-{k - 1}]": {"device": "cpu"}}
        zero = {"offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "module_parameters": pins},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "module_parameters": dict(pins)}}
    return {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, **zero},
            "aio": {"block_size": 1 << 20, "queue_depth": 16, "thread_count": args.io_threads},
            "zinf": {"device": "cuda", "nvme_path": nvme}}


def run_zinf(args, fraction: float) -> dict:
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    cfg = zinf_config(args, fraction, n_params, block_params)
    shutil.rmtree(Path(args.path) / "swap", ignore_errors=True)
    t_init = time.perf_counter()
    engine = zinf.initialize(model, cfg)
    t_init = time.perf_counter() - t_init
    torch.cuda.reset_peak_memory_stats()
    times, traffic = [], []
    with engine:
        for step in range(args.steps):
            x, y = batch(step, args.batch)
            before = copy.deepcopy((engine.traffic_total.read, engine.traffic_total.written))
            loss, seconds = cuda_seconds(lambda: train_step(engine, x, y))
            times.append(seconds)
            r, w = engine.traffic_total.read, engine.traffic_total.written
            traffic.append({"nvme_read": r["nvme"] - before[0]["nvme"], "nvme_written": w["nvme"] - before[1]["nvme"],
                            "h2d": r["cpu"] + r["nvme"] - before[0]["cpu"] - before[0]["nvme"]})
        place = engine.placement
        dram_state = sum(1 for p in place.values() if p["optim"] == "cpu")
        out = {"step_s": times, "traffic": traffic[-1], "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30,
               "init_s": t_init, "dram_need_GiB": engine.dram_need.total_bytes / 2**30, "rss_GiB": rss_bytes() / 2**30,
               "pinned_GiB": engine.pinned_bytes_in_use() / 2**30, "gpu_need_GiB": engine.gpu_need_bytes() / 2**30,
               "shards_optim_in_dram": dram_state, "shards": len(place), "loss": loss.item(),
               "o_direct": engine.o_direct, "last_step": engine.last_step}
    del engine, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True, help="swap directory (on the disk to measure)")
    ap.add_argument("--configs", default="plain,compute,zinf:1,zinf:0.5,zinf:0")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--raw-threads", type=int, default=8, help="readers (and as many writers) of the raw mixed measurement")
    ap.add_argument("--raw-gib", type=float, default=4.0, help="GiB of the sustained raw O_DIRECT measurement")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    Path(args.path).mkdir(parents=True, exist_ok=True)
    # the disk's rate over a burst (256 MiB) and sustained over --raw-gib (a step moves several
    # GB; a cloud disk can be slower over that than over a burst): the roofline uses the latter
    burst_read, burst_write = raw_o_direct_GBps(Path(args.path))
    raw_read, raw_write = raw_o_direct_GBps(Path(args.path), total_bytes=int(args.raw_gib * (1 << 30)))
    (Path(args.path) / "raw-baseline.bin").unlink(missing_ok=True)
    h2d = raw_h2d_GBps()
    n_params = sum(p.numel() for p in build(args).parameters())
    cpu_adamw = raw_cpu_adamw_s(n_params)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "params": n_params, "batch": args.batch, "seq": 512,
            "raw_read_GBps": raw_read, "raw_write_GBps": raw_write,
            "burst_read_GBps": burst_read, "burst_write_GBps": burst_write, "raw_GiB": args.raw_gib, "raw_h2d_GBps": h2d, "cpu_adamw_s": cpu_adamw, "cpu_threads": torch.get_num_threads()}
    print(json.dumps(meta), flush=True)
    results = {}
    for name in args.configs.split(","):
        if name == "plain":
            res = run_plain(args, optimizer=True)
        elif name == "compute":
            res = run_plain(args, optimizer=False)
        else:
            res = run_zinf(args, float(name.split(":")[1]))
        res["median_s"] = statistics.median(res["step_s"][1:] or res["step_s"])
        t = res.get("traffic")
        if t and t["nvme_read"] + t["nvme_written"] > 0:  # the same bytes, read and written at once
            res["raw_mixed_io_s"] = raw_mixed_io_s(Path(args.path), t["nvme_read"], t["nvme_written"], args.raw_threads)
        results[name] = res
        print(json.dumps({"config": name, **res}), flush=True)
    compute_s = results["compute"]["median_s"] if "compute" in results else 0.0
    print(f"\n{n_params / 1e6:.0f} M params, batch {args.batch} x 512, raw read {raw_read:.2f} GB/s, "
          f"write {raw_write:.2f} GB/s (over {args.raw_gib:g} GiB; 256 MiB burst {burst_read:.2f} / {burst_write:.2f}), pinned H2D {h2d:.1f} GB/s, compute floor {compute_s:.3f} s, "
          f"CPU AdamW floor {cpu_adamw:.3f} s")
    print(f"{'config':<10} {'step s':>8} {'roofline s':>10} {'ratio':>6} {'peak GPU GiB':>12} {'NVMe rd GB':>10} {'NVMe wr GB':>10}")
    for name, res in results.items():
        t = res.get("traffic")
        if t:
            disk_s = t["nvme_read"] / 1e9 / raw_read + t["nvme_written"] / 1e9 / raw_write  # one after the other
            disk_s = min(disk_s, res.get("raw_mixed_io_s", disk_s))  # or at once, whichever the disk does faster
            roof = max(compute_s, disk_s, t["h2d"] / 1e9 / h2d, cpu_adamw)
            res["roofline_s"] = roof
            print(f"{name:<10} {res['median_s']:>8.3f} {roof:>10.3f} {res['median_s'] / roof:>6.2f} {res['peak_gpu_GiB']:>12.2f} "
                  f"{t['nvme_read'] / 1e9:>10.2f} {t['nvme_written'] / 1e9:>10.2f}")
        else:
            print(f"{name:<10} {res['median_s']:>8.3f} {'':>10} {'':>6} {res['peak_gpu_GiB']:>12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
