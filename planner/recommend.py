"""What to configure, from a profiled run: the ``aio`` settings, and the DeepSpeed config for a
user who stays on DeepSpeed at a chosen DRAM budget.

**aio** (:func:`recommend_aio`), from the best evidence there is, in this order:

1. the run's own autotuner (``zinf.autotune``): the setting it kept (``tuning_trials.chosen``),
   measured as whole training steps of this run - the best evidence;
2. ``zinf bench-io`` results of the run's swap disk (``calibrations``; the newest bench-io run of
   the directory or a folder above it, else of any directory, said in the note): the setting with
   the best read+write throughput (the harmonic mean of its read and write GB/s, bench-io's own
   criterion);
3. neither: the settings the run ran with, and a note saying how to measure better ones.

**DeepSpeed** (:func:`recommend_deepspeed`). DeepSpeed cannot place shard by shard; what it
offers is ``offload_param.max_in_cpu`` (the first N parameter elements in model order keep a DRAM
copy, the rest live on NVMe) and ``offload_optimizer.device`` ("cpu" or "nvme" for all of the
optimizer state). The recommendation is the largest ``max_in_cpu`` whose params fit the budget
beside what DeepSpeed needs anyway - with the optimizer state on NVMe and, when all of it fits
in DRAM too, with it in DRAM - whichever of the two zinf's simulator predicts faster:

* ``buffer_size`` (elements) = the largest shard's elements: DeepSpeed's NVMe param buffers must
  hold the largest parameter (zinf's shards are at least as large as any parameter in them);
* ``buffer_count`` = DeepSpeed's default 5, fewer when the budget cannot hold 5 (at least 1);
* DRAM is counted as zinf counts it (:attr:`planner.whatif.WhatIf.base_bytes`: working set and
  staging; optimizer read-ahead and write-behind when the optimizer is on NVMe; the param
  buffers; then the homes, by ``zinf.placement``'s rule for ``max_in_cpu``: shards in model order,
  each taken while the elements taken stay within N). DeepSpeed's own footprint differs (its
  pinned buffers, allocator), so leave some margin;
* ``max_in_cpu`` is found by bisection (as ``benchmarks/planner_policies.py`` does against the
  real engine), so it is a count that fits: with shards of mixed sizes a larger one may fit too;
* ``pin_memory``: on when the run had a GPU (page-locked buffers make host-to-device copies
  faster; on a CPU-only machine pinning only locks memory).

Everything here is a plain dataclass whose :meth:`to_dict` is JSON-serialisable.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from zinf.config import Config, load_config
from zinf.placement import fmt_bytes

from profiler import queries

from planner.costmodel import _calibrations_for, _clean_calibrations  # the cost model's rules for which rows count
from planner.simulator import simulate
from planner.whatif import Buffers, WhatIf
from planner.workload import home_dram_bytes

__all__ = ["AioRecommendation", "DeepSpeedRecommendation", "Recommendation", "recommend", "recommend_aio",
           "recommend_deepspeed", "DEEPSPEED_BUFFER_COUNT"]

DEEPSPEED_BUFFER_COUNT = 5
"""DeepSpeed's default ``offload_param.buffer_count``."""
DEEPSPEED_OPTIMIZER_BUFFER_COUNT = 4
"""DeepSpeed's default ``offload_optimizer.buffer_count``."""


@dataclass
class AioRecommendation:
    """The ``aio`` section to use (DeepSpeed's keys; zinf reads the same)."""

    block_size: int
    """Bytes per I/O request."""
    queue_depth: int
    """Requests in flight per I/O thread."""
    thread_count: int
    """I/O threads."""
    single_submit: bool = False
    """Submit requests one at a time (off: in batches)."""
    overlap_events: bool = True
    """Submit new requests while earlier ones complete."""
    prefetch_bytes: int | None = None
    """The parameter prefetch window the autotuner kept (bytes); None when the run did not tune it."""
    source: str = "run_config"
    """Where the numbers come from: "tuning_trials", "calibrations" or "run_config"."""
    note: str = ""
    """Why these numbers, in a sentence (and how to get better ones, where that applies)."""

    def as_deepspeed(self) -> dict[str, Any]:
        """The ``"aio"`` section."""
        return {"block_size": int(self.block_size), "queue_depth": int(self.queue_depth),
                "thread_count": int(self.thread_count), "single_submit": bool(self.single_submit),
                "overlap_events": bool(self.overlap_events)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DeepSpeedRecommendation:
    """The DeepSpeed ZeRO-3 offload config for one DRAM budget (see the module docstring)."""

    dram_budget_bytes: int
    """The budget it was made for."""
    offload_param_device: str
    """"nvme" (some or all params on NVMe) or "cpu" (every param fits in DRAM)."""
    max_in_cpu: int
    """Parameter elements kept in DRAM (the first ones in model order)."""
    buffer_count: int
    """``offload_param.buffer_count``: NVMe param buffers."""
    buffer_size: int
    """``offload_param.buffer_size``, in elements (DeepSpeed's unit): >= the largest parameter."""
    pin_memory: bool
    """Page-locked buffers (the run had a GPU)."""
    offload_optimizer_device: str
    """"nvme" or "cpu" (all of the optimizer state in DRAM)."""
    stage3_prefetch_bucket_size: int
    """Parameter elements prefetched ahead of use."""
    aio: AioRecommendation
    nvme_path: str
    """The swap directory (the run's ``nvme_path``)."""
    dram_need_bytes: int
    """DRAM this config needs, counted as zinf counts it (homes, working set, staging, buffers)."""
    predicted_step_s: float | None = None
    """zinf's simulator's step time for this placement (zinf's engine; DeepSpeed's own will differ)."""
    alternatives: dict[str, float] = field(default_factory=dict)
    """Predicted step (s) of each option weighed: "optimizer on nvme", "optimizer in cpu"."""
    note: str = ""

    def config(self) -> dict[str, Any]:
        """The DeepSpeed config fragment: ``zero_optimization`` and ``aio``."""
        param: dict[str, Any] = {"device": self.offload_param_device, "pin_memory": self.pin_memory}
        if self.offload_param_device == "nvme":
            param.update(nvme_path=self.nvme_path, buffer_count=self.buffer_count, buffer_size=self.buffer_size,
                         max_in_cpu=self.max_in_cpu)
        optim: dict[str, Any] = {"device": self.offload_optimizer_device, "pin_memory": self.pin_memory}
        if self.offload_optimizer_device == "nvme":
            optim.update(nvme_path=self.nvme_path, buffer_count=DEEPSPEED_OPTIMIZER_BUFFER_COUNT,
                         pipeline_read=True, pipeline_write=True)
        zero = {"stage": 3, "offload_param": param, "offload_optimizer": optim,
                "stage3_prefetch_bucket_size": int(self.stage3_prefetch_bucket_size)}
        return {"zero_optimization": zero, "aio": self.aio.as_deepspeed()}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = self.config()
        return out


@dataclass
class Recommendation:
    """Both recommendations for one run."""

    run_id: int
    aio: AioRecommendation
    deepspeed: DeepSpeedRecommendation

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "aio": self.aio.to_dict(), "deepspeed": self.deepspeed.to_dict()}


# ------------------------------------------------------------------------------ aio
def recommend_aio(src, run_id: int, *, info: dict | None = None, config: Config | None = None) -> AioRecommendation:
    """The ``aio`` settings for run ``run_id`` of ``src`` (see the module docstring for the order
    of evidence). ``info``/``config``: the run's, when the caller has them already."""
    info = info if info is not None else queries.run_info(src, run_id)
    cfg = config if config is not None else load_config(info["config"])
    aio = cfg.aio
    own = dict(block_size=int(aio.block_size), queue_depth=int(aio.queue_depth), thread_count=int(aio.thread_count),
               single_submit=bool(aio.single_submit), overlap_events=bool(aio.overlap_events))

    trials = queries.tuning_trials(src, run_id)
    if len(trials):
        chosen = trials[trials["chosen"].astype(bool)]
        if chosen.empty:  # tuning ended early: the fastest trial measured
            measured = trials[trials["step_s"].notna()]
            chosen = measured.nsmallest(1, "step_s") if len(measured) else chosen
        if len(chosen):
            row = chosen.iloc[-1]
            setting = row["setting"]
            setting = json.loads(setting) if isinstance(setting, str) else dict(setting or {})
            got = {k: int(setting[k]) for k in ("block_size", "queue_depth", "thread_count") if setting.get(k) is not None}
            step = row["step_s"]
            step_text = f"median step {step:.3f} s" if step is not None and not pd.isna(step) else "step not measured"
            return AioRecommendation(**{**own, **got}, prefetch_bytes=_int_or_none(setting.get("prefetch_bytes")),
                                     source="tuning_trials",
                                     note=f"kept by the run's autotuner (zinf.autotune) out of {len(trials)} trial(s), {step_text}")

    best = _best_calibration(src, info.get("swap_dir"))
    if best is not None:
        setting, note = best
        return AioRecommendation(**{**own, **setting}, source="calibrations", note=note)

    where = info.get("swap_dir") or str(cfg.param_nvme_path)
    return AioRecommendation(**own, source="run_config", note=(
        f"the settings run {run_id} ran with: it did not auto-tune and no `zinf bench-io` results are in this database; "
        f"measure with `zinf bench-io --path {where} --db URL` or train with \"zinf\": {{\"autotune\": {{\"enabled\": true}}}}"))


def _best_calibration(src, swap_dir: str | None) -> tuple[dict[str, int], str] | None:
    """(setting, note) of the bench-io setting with the best read+write throughput, or None."""
    cal = _clean_calibrations(queries.calibrations(src))
    if cal is None or len(cal) == 0:
        return None
    cal = _calibrations_for(cal, swap_dir)
    keys = ["block_size", "queue_depth", "thread_count"]
    cal = cal.dropna(subset=keys)
    if cal.empty:
        return None
    per = cal.groupby(keys + ["op"])["GBps"].median().unstack("op")
    if "read" not in per or "write" not in per:
        return None
    per = per.dropna(subset=["read", "write"])
    if per.empty:
        return None
    combined = 2.0 / (1.0 / per["read"] + 1.0 / per["write"])  # equal bytes read and written: harmonic mean
    best = combined.idxmax()
    setting = {k: int(v) for k, v in zip(keys, best)}
    paths = sorted(set(cal["path"].astype(str)))
    where = ", ".join(paths)
    note = (f"best of {len(per)} setting(s) `zinf bench-io` measured on {where}: {per.loc[best, 'read']:.2f} GB/s read, "
            f"{per.loc[best, 'write']:.2f} GB/s write")
    if cal.attrs.get("foreign_path"):
        note += f" (no bench-io run of the run's swap directory {cal.attrs['foreign_path']}: measured elsewhere)"
    return setting, note


def _int_or_none(x) -> int | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else int(x)


# ------------------------------------------------------------------------------ DeepSpeed
def _first_n_in_dram(numel: np.ndarray, max_in_cpu: int) -> np.ndarray:
    """Which shards keep a DRAM param copy under ``max_in_cpu`` (``zinf.placement.static_placement``'s
    rule: in model order, a shard is taken while the elements taken stay within the limit)."""
    taken = np.zeros(len(numel), dtype=bool)
    used = 0
    for i, n in enumerate(numel.tolist()):
        if used + n <= max_in_cpu:
            taken[i] = True
            used += n
    return taken


def _largest_fitting(fits, total: int) -> int:
    """The largest N in [0, total] with ``fits(N)`` by bisection (``fits(0)`` assumed)."""
    if fits(total):
        return total
    lo, hi = 0, total  # invariant: fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def recommend_deepspeed(wi: WhatIf, dram_budget_bytes: int, aio: AioRecommendation) -> DeepSpeedRecommendation:
    """The DeepSpeed offload config for ``dram_budget_bytes`` of DRAM (see the module docstring)."""
    wl = wi.workload
    df = wl.shards
    budget = int(dram_budget_bytes)
    numel = df["numel"].to_numpy(np.int64)
    total = int(numel.sum())
    trainable = df["trainable"].to_numpy(bool)
    elem_bytes = max(1, int(round(df["param_bytes"].sum() / max(1, total))))  # compute dtype
    group = int((df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)[trainable].max()) if trainable.any() else 0
    optim_all = int((df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)[trainable].sum())
    buffer_size = int(numel.max()) if len(numel) else 1
    buffer_bytes = buffer_size * elem_bytes
    notes: list[str] = []

    # NVMe params need the param buffers (they come before any DRAM copy of a param); the
    # optimizer on NVMe needs one group read ahead and two written behind
    pipeline = 3 * group
    left = budget - wi.base_bytes - pipeline
    buffer_count = int(max(1, min(DEEPSPEED_BUFFER_COUNT, left // max(1, buffer_bytes))))
    param_buffers = buffer_count * buffer_bytes

    def placement_for(n: int, optim_tier: str) -> dict[str, dict[str, str]]:
        in_dram = _first_n_in_dram(numel, n)
        return {name: {"param": "cpu" if d else "nvme", "optim": optim_tier if t else "none"}
                for name, d, t in zip(df["shard"].tolist(), in_dram.tolist(), trainable.tolist())}

    def homes(n: int, optim_tier: str) -> int:
        p = placement_for(n, optim_tier)
        return int(home_dram_bytes(wl, [p[s]["param"] for s in wl.names], [p[s]["optim"] for s in wl.names]).sum())

    options: dict[str, tuple[int, dict, int]] = {}  # label -> (max_in_cpu, placement, DRAM need)
    for label, optim_tier, fixed in (("optimizer on nvme", "nvme", wi.base_bytes + pipeline),
                                     ("optimizer in cpu", "cpu", wi.base_bytes)):
        if homes(total, optim_tier) <= budget - fixed:  # every param in DRAM: no NVMe param buffers
            options[label] = (total, placement_for(total, optim_tier), fixed + homes(total, optim_tier))
            continue
        room = budget - fixed - param_buffers
        if homes(0, optim_tier) > room:
            continue  # e.g. all of the optimizer state in DRAM does not fit
        n = _largest_fitting(lambda n: homes(n, optim_tier) <= room, total)
        options[label] = (n, placement_for(n, optim_tier), fixed + param_buffers + homes(n, optim_tier))
    if not options:  # even all-NVMe with the buffers is over the budget: the smallest config, said so
        label = "optimizer on nvme"
        options[label] = (0, placement_for(0, "nvme"), wi.base_bytes + pipeline + param_buffers + homes(0, "nvme"))
        notes.append(f"the budget {fmt_bytes(budget)} is below what this config needs "
                     f"({fmt_bytes(options[label][2])}); DeepSpeed will use more DRAM than the budget")
    def predict(n: int, placement: dict, optim_tier: str) -> float:
        """zinf's simulator on this placement with the buffers counted for it (no updates during
        backward: DeepSpeed has none)."""
        buffers = Buffers(prefetch_bytes=param_buffers if n < total else 0,
                          write_bytes=2 * group if optim_tier == "nvme" else 0,
                          read_ahead_bytes=group if optim_tier == "nvme" else 0)
        return float(simulate(buffers.apply(wl), placement, wi.cost_model).step_s)

    predicted = {label: predict(n, placement, "nvme" if label == "optimizer on nvme" else "cpu")
                 for label, (n, placement, _) in options.items()}
    label = min(predicted, key=predicted.get)
    n, placement, need = options[label]
    if n < total and buffer_count < DEEPSPEED_BUFFER_COUNT:
        notes.insert(0, f"buffer_count {buffer_count} (not DeepSpeed's default {DEEPSPEED_BUFFER_COUNT}): "
                        f"the budget holds no more buffers of {fmt_bytes(buffer_bytes)}")
    if len(options) > 1:
        other = next(k for k in options if k != label)
        notes.append(f"{label} predicted {predicted[label]:.3f} s a step, {other} {predicted[other]:.3f} s")
    cfg = wi.config
    zero = cfg.zero_optimization
    if zero.offload_param.module_parameters or zero.offload_optimizer.module_parameters:
        notes.append("DeepSpeed has no per-module pins: the run's module_parameters are not kept here")
    prefetch_elems = int(cfg.zero_optimization.stage3_prefetch_bucket_size)
    if aio.prefetch_bytes:
        prefetch_elems = max(1, aio.prefetch_bytes // elem_bytes)
        notes.append("stage3_prefetch_bucket_size from the prefetch window the autotuner kept")
    gpu = bool((wi.info.get("hardware") or {}).get("gpu"))
    return DeepSpeedRecommendation(
        dram_budget_bytes=budget, offload_param_device="cpu" if n >= total else "nvme", max_in_cpu=int(n),
        buffer_count=buffer_count, buffer_size=buffer_size, pin_memory=gpu,
        offload_optimizer_device="cpu" if label == "optimizer in cpu" else "nvme",
        stage3_prefetch_bucket_size=prefetch_elems, aio=aio, nvme_path=str(cfg.param_nvme_path),
        dram_need_bytes=int(need), predicted_step_s=predicted[label], alternatives=predicted, note="; ".join(notes))


def recommend(src, run_id: int | None = None, dram_budget_bytes: int | None = None, *, whatif: WhatIf | None = None) -> Recommendation:
    """Both recommendations for run ``run_id`` (None: the newest) of ``src`` at
    ``dram_budget_bytes`` (None: the run's ``zinf.dram_budget``, else its all-DRAM endpoint).
    ``whatif``: the run's :class:`WhatIf`, when the caller has built it already."""
    wi = whatif if whatif is not None else WhatIf.from_profile(src, run_id)
    budget = dram_budget_bytes if dram_budget_bytes is not None else (wi.config.zinf.dram_budget or wi.all_dram_budget_bytes)
    aio = recommend_aio(src, wi.run_id, info=wi.info, config=wi.config)
    return Recommendation(run_id=wi.run_id, aio=aio, deepspeed=recommend_deepspeed(wi, budget, aio))
