"""All-NVMe training keeps the process's peak RSS within the DRAM budget plus a computed constant.

The model's fp32 training state (param, grad, master, exp_avg, exp_avg_sq: 20 bytes a parameter)
is at least 4x the DRAM budget, so keeping it in DRAM would break the bound by far. The bound,
computed analytically in the style of FSDP2's memory tests:

    peak_rss <= baseline_rss + dram_budget + activations + slack

* ``baseline_rss``: the process after importing torch and zinf and running one tiny op (threads,
  kernels, the Python heap), measured before the model is built;
* ``dram_budget``: everything the engine holds (homes, materialised params, staging buffers,
  gradient and optimizer buffers in flight) — the engine refuses placements whose analytic need
  (:class:`zinf.placement.DramNeed`) exceeds it;
* ``activations``: what autograd saves for backward, per transformer layer
  ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit (Korthikanti et al., 2022), doubled for fp32, plus the
  logits and their gradient (3 x b*s*vocab*4 bytes);
* ``slack``: 48 MiB for allocator fragmentation and Python objects.

The peak is the kernel's VmHWM, reset after ``initialize`` (the user's model is built in DRAM
before zinf moves it to NVMe; that build is the user's memory, not the engine's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(2)
    import zinf
    from zinf.hardware import rss_bytes, peak_rss_bytes, reset_peak_rss
    from zinf.models import build_model
    from zinf.models.data import TokenBatches, markov_tokens
    torch.ones(4, 4) @ torch.ones(4, 4)
    baseline = rss_bytes()
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "demo")
    n = sum(p.numel() for p in model.parameters())
    state = 20 * n
    budget = state // 4
    swap = sys.argv[1]
    config = {
        "optimizer": {"type": "AdamW"},
        "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": swap},
                              "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
        "zinf": {"dram_budget": budget, "shard_min_bytes": "256KiB", "chunk_size": "1MiB",
                 "staging_buffers": 2, "staging_buffer_size": "1MiB"},
    }
    B, T = 4, cfg.block_size
    data = TokenBatches(markov_tokens(cfg.vocab_size, 50_000), B, T)
    with zinf.initialize(model, config) as engine:
        need = engine.dram_need.total_bytes
        reset_peak_rss()
        for i in range(3):
            x, y = data.get(i)
            engine.backward(engine(x, y))
            engine.step()
        peak = peak_rss_bytes()
    h, a, L, V = cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.vocab_size
    act = L * T * B * h * (34 + 5 * a * T / h) * 2 + 3 * B * T * V * 4
    print(json.dumps(dict(baseline=baseline, budget=budget, need=need, state=state, act=act, peak=peak)))
    """
)

SLACK = 48 << 20


def test_all_nvme_peak_rss_within_budget_plus_constant(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "swap")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["state"] >= 4 * m["budget"]
    assert m["need"] <= m["budget"]
    bound = m["baseline"] + m["budget"] + m["act"] + SLACK
    mib = {k: round(v / 2**20, 1) for k, v in m.items()}
    assert m["peak"] <= bound, f"peak RSS over the analytic bound: {mib}, bound {bound / 2**20:.1f} MiB"
    # the bound is not vacuous: state in DRAM would have exceeded it
    assert m["baseline"] + m["state"] > bound, mib
    print("memory (MiB):", mib, "bound", round(bound / 2**20, 1))
