"""Achieved host <-> device bandwidth of zinf's transfers ÷ a raw pinned copy of the same bytes,
measured side by side on one GPU (issue 7, benchmark a).

    python benchmarks/gpu_transfer.py [--d 1024 --layers 24] [--repeats 5]

The benchmark GPT (gpu_model.py, bf16) with every param home in pinned DRAM is run on a tiny
input (1 sequence of 16 tokens), so compute is negligible and the time is the transfers':

* ``upload``: a forward under ``torch.no_grad()``: every non-resident shard is uploaded once
  (side stream, ahead along the trace); bytes = the shards' bf16 bytes;
* ``upload + download``: a forward and backward with the optimizer step left out of the timing:
  uploads twice (forward, backward) and every gradient downloaded into pinned memory and
  accumulated into its fp32 accumulator on the CPU;

against the raw copies of the same shard sizes, one after another, pinned -> device
(``copy_(non_blocking=True)``) and device -> pinned. Ratios are medians of ``--repeats``
interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zinf  # noqa: E402
from gpu_model import GPT, cuda_seconds  # noqa: E402


def raw_copies(sizes: list[int], direction: str) -> float:
    """Seconds to copy buffers of ``sizes`` bytes one after another (pinned <-> device)."""
    host = [torch.empty(n, dtype=torch.uint8).pin_memory() for n in sizes]
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    pairs = list(zip(dev, host)) if direction == "h2d" else list(zip(host, dev))
    return cuda_seconds(lambda: [dst.copy_(src, non_blocking=True) for dst, src in pairs])[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(args.d, args.layers)
    cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "zinf": {"device": "cuda"}}
    x = torch.randint(0, 32000, (1, 16))
    y = torch.roll(x, -1, 1)
    rows = {"upload": [], "upload + download": []}
    with zinf.initialize(model, cfg) as engine:
        sizes = [engine._nbytes(st)[0] for st in engine.states if st.place.param == "cpu"]
        grad_sizes = [engine._nbytes(st)[0] for st in engine.states if st.shard.trainable]
        up_bytes = sum(sizes)
        for rep in range(args.repeats + 2):  # two warm-up rounds (the first records the trace)
            with torch.no_grad():
                _, fwd_s = cuda_seconds(lambda: engine(x, y))
            raw_up = raw_copies(sizes, "h2d")
            _, fb_s = cuda_seconds(lambda: engine.backward(engine(x, y)))
            engine.step()
            raw_fb = 2 * raw_copies(sizes, "h2d") + raw_copies(grad_sizes, "d2h")
            if rep >= 2:
                rows["upload"].append((fwd_s, raw_up))
                rows["upload + download"].append((fb_s, raw_fb))
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params, {len(sizes)} shards uploaded, "
          f"{up_bytes / 1e9:.2f} GB a pass, {torch.cuda.get_device_name()}")
    print(f"{'transfer':<20} {'zinf GB/s':>10} {'raw GB/s':>10} {'zinf ÷ raw':>10}")
    for name, pairs in rows.items():
        nbytes = up_bytes if name == "upload" else 2 * up_bytes + sum(grad_sizes)
        zinf_s = statistics.median(p[0] for p in pairs)
        raw_s = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[1] / p[0] for p in pairs)
        print(f"{name:<20} {nbytes / zinf_s / 1e9:>10.1f} {nbytes / raw_s / 1e9:>10.1f} {ratio:>10.2f}")


if __name__ == "__main__":
    main()
