"""The DeepSpeed ZeRO-3 baseline of benchmarks/gpu_gpt.py: the same model (gpu_model.GPT), batch,
data, precision (bf16) and optimizer (AdamW, lr 1e-4) under DeepSpeed with parameters and
optimizer state offloaded to DRAM or NVMe. Recipe and caveats: ../shared/gpu/DEEPSPEED.md
(DeepSpeed 0.19.8; ``TORCH_CUDA_ARCH_LIST=9.0`` for its async_io JIT build; pipelined optimizer
swapping crashes there, so ``pipeline_read/write`` stay off).

    python benchmarks/gpu_deepspeed.py --offload nvme --path /tmp/ds-swap [--max-in-cpu N] --json out.json

DeepSpeed's only knob between "all in DRAM" and "all on NVMe" is ``offload_param.max_in_cpu``
(parameter elements kept in DRAM); its optimizer state is all in DRAM or all on NVMe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_model import GPT, batch, cuda_seconds, train_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offload", choices=["cpu", "nvme"], required=True)
    ap.add_argument("--path", default="/tmp/ds-swap")
    ap.add_argument("--max-in-cpu", type=float, default=None, help="offload_param.max_in_cpu (elements), nvme only")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--json")
    args = ap.parse_args()
    import deepspeed

    Path(args.path).mkdir(parents=True, exist_ok=True)
    off = {"device": args.offload, "pin_memory": True}
    if args.offload == "nvme":
        off["nvme_path"] = args.path
    param = dict(off, buffer_count=8, buffer_size=2e8)
    if args.max_in_cpu is not None:
        param["max_in_cpu"] = args.max_in_cpu
    optim = dict(off) if args.offload == "cpu" else dict(off, buffer_count=4, pipeline_read=False, pipeline_write=False)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": optim, "sub_group_size": 1e8},
           "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 4, "single_submit": False,
                   "overlap_events": True}}
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT(args.d, args.layers)
    n = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps):
        x, y = batch(step, args.batch, "cuda")
        loss, seconds = cuda_seconds(lambda: train_step(engine, x, y))
        times.append(seconds)
        print(f"step {step} {times[-1]:.3f} s loss {loss.item():.4f}", flush=True)
    from zinf.hardware import rss_bytes

    res = {"config": f"ds:{args.offload}" + (f":max_in_cpu={args.max_in_cpu:g}" if args.max_in_cpu is not None else ""),
           "params": n, "step_s": times, "median_s": statistics.median(times[1:] or times),
           "peak_gpu_GiB": torch.cuda.max_memory_allocated() / 2**30, "rss_GiB": rss_bytes() / 2**30, "loss": loss.item()}
    print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
