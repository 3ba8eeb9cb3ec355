"""What the planner knows about one training run: its shards, how often each is used, how long the
compute takes, and the engine settings that decide how I/O overlaps with it.

A :class:`Workload` is a per-shard table (:attr:`Workload.shards`, one row per shard in first-use
order) plus a few step-level numbers. Everything the simulator and the solver need is here; nothing
in it depends on where the shards live *now*, except :attr:`Workload.measured_placement` (used only
to calibrate the simulator against the measured step).

Shard table columns (units in the names; one row per shard, sorted by ``order``):

============================  ===================================================================
``shard``                     the shard's name (a key of ``engine.placement``)
``kind``                      "param", "chunk", "embedding", "expert", "frozen"
``order``                     first-use order along the forward. The profile has no module trace
                              (yet), so this is the engine's shard index, which follows model
                              (registration) order, zinf's proxy for first use (``zinf.shards``)
``numel``                     elements
``param_bytes``               bytes of the working copy (compute dtype): one param fetch from NVMe
``optim_bytes``               bytes of master + moments (fp32): one NVMe group read, one write-back
``grad_bytes``                bytes of the fp32 gradient accumulator (0 for frozen shards)
``chunk``                     several parameters packed together: fetched once per pass and held
                              for the whole pass (forward and backward), as the engine does
``trainable``                 has a gradient and an optimizer group
``fwd_accesses_per_step``     uses in forward per optimizer step (all micro-batches together)
``bwd_accesses_per_step``     uses in backward (recompute included) per optimizer step
``opt_accesses_per_step``     optimizer updates per step (in [0, 1]; < 1 for experts that get no
                              token in some steps)
``unstable``                  the short and the long EWMA of its accesses disagree (see hotness)
``compute_weight``            relative compute of one access (default ``numel``: a dense layer's
                              FLOPs are proportional to its weights; wrong for embeddings)
``pin_param``/``pin_optim``   the tier the user pinned the home to, or None (the planner's to choose)
``param_tier``/``optim_tier`` the tiers when the profile was taken (``optim_tier`` "none" if frozen)
============================  ===================================================================

A workload from a profile also has ``accesses_short`` and ``accesses_long``: all accesses per step
under the short and the long EWMA, whichever ``rate`` filled the columns above; and
``accesses_max``: the most accesses the shard had in one step of the rate window (a routed expert
hit in every micro-batch is at its cap and does not vary: the planner's noise model uses it).

Step-level numbers (seconds per optimizer step unless said otherwise): ``compute_fwd_s`` and
``compute_bwd_s`` (measured phase seconds minus the stall inside them), ``update_s_per_elem`` and
``update_overhead_s`` (one optimizer update of a shard takes ``update_overhead_s + numel *
update_s_per_elem``), ``fetch_overhead_s`` (the non-I/O cost of materialising an NVMe param:
waiting on the future, resizing the storage, the copy out of the I/O buffer), ``measured_step_s``.

Assumptions made when building from a profile (:meth:`Workload.from_profile`):

* Steps: the last ``last_steps`` steps, without the run's first step (it records the prefetch
  trace and runs without prefetch). Step numbers are medians over them.
* Compute: ``forward_s + backward_s - stall_s`` is the compute of both passes; it is split between
  them assuming the same stall fraction in both (the profile records the stall per step, not per
  phase).
* Update seconds: from the updates the engine timed (``shard_steps.update_s``), fitted
  ``seconds = overhead + numel * s_per_elem`` robustly. Profiles older than schema 0003: from the
  shards whose both homes are in DRAM (their recorded optimizer seconds are the update alone);
  without such shards, measured by timing zinf's own optimizer update on this machine
  (``measure_update``), because the recorded optimizer seconds of an NVMe group include waiting
  for its reads.
* Fetch overhead (the non-I/O part of an NVMe param fetch) and the upload cost of a DRAM param
  (CUDA): from ``shard_steps.fetch_overhead_s`` and ``fetch_s``, not ``stall_s``, which also holds
  the shard's gradient read-backs and write waits.
* DRAM the homes cannot use (``reserved_dram_bytes``): the engine's working set, staging buffers
  and wanted overlap at the all-NVMe placement (an upper bound; see :func:`engine_reserved_bytes`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from zinf.config import load_config
from zinf.errors import ZinfError
from zinf.pins import PinSet

from profiler import queries

__all__ = [
    "Workload",
    "WorkloadError",
    "SHARD_COLUMNS",
    "DRAM_TIERS_CPU",
    "DRAM_TIERS_CUDA",
    "home_dram_bytes",
    "engine_reserved_bytes",
    "measure_update",
    "measure_io_cpu",
    "IoCpuTiming",
    "normalize_placement",
]

SHARD_COLUMNS = [
    "shard", "kind", "order", "numel", "param_bytes", "optim_bytes", "grad_bytes", "chunk", "trainable",
    "fwd_accesses_per_step", "bwd_accesses_per_step", "opt_accesses_per_step", "unstable", "compute_weight",
    "pin_param", "pin_optim", "param_tier", "optim_tier",
]

DRAM_TIERS_CPU = ("cpu", "gpu")
"""Tiers that are host DRAM when the compute device is the CPU (a "gpu" home is the CPU there)."""
DRAM_TIERS_CUDA = ("cpu",)
"""Tiers counted against the DRAM budget on a CUDA machine (as the engine's ``_dram_need`` does)."""

_DEVICE_TO_TIER = {"none": "gpu", "gpu": "gpu", "cpu": "cpu", "nvme": "nvme"}


class WorkloadError(ZinfError):
    """The profile cannot describe a workload (no steps, no shards, unknown placement keys)."""


@dataclass
class Workload:
    """One run as the planner sees it. Build with :meth:`from_profile` or :meth:`from_rows`."""

    shards: pd.DataFrame
    """One row per shard, sorted by ``order``; columns :data:`SHARD_COLUMNS` (see the module doc)."""
    compute_fwd_s: float
    """Forward compute per optimizer step (all micro-batches), stall excluded."""
    compute_bwd_s: float
    """Backward compute per optimizer step, stall excluded."""
    update_s_per_elem: float
    """Seconds of one optimizer update per element (on the CPU)."""
    update_overhead_s: float = 0.0
    """Fixed seconds per shard update (Python, per-member loops)."""
    fetch_overhead_s: float = 0.0
    """Seconds of one NVMe param materialisation beyond its read (future, resize, copy)."""
    fetch_overhead_measured: bool = True
    """Whether :attr:`fetch_overhead_s` was measured (on this profile's NVMe param fetches, or
    on an earlier read's: :meth:`with_fetch_overhead`), rather than 0 for want of any fetch."""
    copy_Bps: float = math.inf
    """Bytes/s of copying a DRAM param home to the compute device (inf on a CPU device: resident)."""
    copy_measured: bool = False
    """Whether :attr:`copy_Bps` was measured on this profile's DRAM param fetches (CUDA), rather
    than assumed (none recorded) or not needed (a CPU device)."""
    micro_batches: int = 1
    """Micro-batches (forward + backward passes) per optimizer step."""
    prefetch_bytes: int = 0
    """The engine's parameter prefetch window (``Overlap.prefetch_bytes``)."""
    reuse_distance_bytes: int = 0
    """``stage3_max_reuse_distance`` in bytes: a released param needed again within it is kept."""
    pipeline_read: bool = True
    """The optimizer phase reads the next NVMe group while updating this one."""
    write_window_bytes: int | None = None
    """NVMe writes that may be in flight behind compute; None: the engine's 2 x largest NVMe group
    (``pipeline_write``); 0: writes are synchronous."""
    updates_during_backward: bool = False
    """NVMe groups are updated during backward (``zinf.overlap_optimizer`` with clipping off)."""
    dram_updates_during_backward: bool = False
    """Shards whose optimizer home is in DRAM are updated on the optimizer worker during the last
    backward (the engine does so with CUDA, ``zinf.overlap_optimizer``, clipping off and no fp16:
    the CPU is free while the GPU computes); needs no overlap buffer, so a budget never turns it off."""
    announced_reads: bool = False
    """The model announces the modules it runs next (``zinf.will_use``: the MoE layer names its
    routed experts) and the engine reads them ahead on its word: a seldom-used module's forward
    read starts when its run of such modules begins, not when it is called (a miss). Set by the
    planner from the engine (``Engine.announced_reads``); the profile does not record it."""
    param_file_is_master: bool = False
    """fp32 params with both homes on NVMe in one store share the master file (no param rewrite)."""
    aliases_master: bool = False
    """fp32: a shard with both homes in DRAM keeps one copy (no param home bytes): on the CPU device
    the parameter is the master, with a GPU the master is the DRAM home uploads read from."""
    device: str = "cpu"
    """The compute device type: "cpu" or "cuda"."""
    cpu_contention: float = 0.0
    """Fraction of an update run during backward (on the optimizer worker) that also delays the
    main thread: 1 when both compute on the same CPU cores (a CPU device), 0 when the compute is on
    a GPU and the worker has a core of its own."""
    disk_servers: int = 1
    """NVMe requests served at once: the store's request threads, ``max(2, aio.thread_count)``."""
    io_cpu_s_per_byte: float = 0.0
    """Compute seconds the training thread loses per NVMe byte the store moves (a CPU device: the
    store's request threads run on the cores torch computes on; :func:`measure_io_cpu`, 0.45-0.51
    ms per MB on the 2-core VM). 0 with a GPU computing, or where not measured."""
    io_cpu_base_bytes: float = 0.0
    """NVMe bytes per step (read + written) of the measured steps: their compute (phase time -
    stall) already ran beside these, so a placement is charged ``io_cpu_s_per_byte`` only for the
    bytes it moves beyond them (and credited for those it moves less)."""
    reserved_dram_bytes: int = 0
    """DRAM the homes cannot use: working set + staging buffers + wanted overlap."""
    measured_step_s: float | None = None
    """Median measured wall seconds of a step (None for a synthetic workload)."""
    measured: dict[str, float] = field(default_factory=dict)
    """Median measured phase seconds: ``forward_s, backward_s, optimizer_s, stall_s, wall_s``."""
    measured_placement: dict[str, dict[str, str]] | None = None
    """{shard: {"param": tier, "optim": tier}} at the end of the profiled steps."""
    overhead_s: float = 0.0
    """Calibrated seconds per step outside what the simulator models (see ``simulator.calibrate``)."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where the numbers came from (url, run id, steps used, how each estimate was made)."""

    def __post_init__(self) -> None:
        missing = [c for c in SHARD_COLUMNS if c not in self.shards.columns]
        if missing:
            raise WorkloadError(f"workload shard table lacks column(s) {', '.join(missing)}; build it with Workload.from_rows")
        self.shards = self.shards.sort_values("order", kind="stable").reset_index(drop=True)
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------------ derived
    @property
    def names(self) -> list[str]:
        return self.shards["shard"].tolist()

    @property
    def dram_tiers(self) -> tuple[str, ...]:
        return DRAM_TIERS_CPU if self.device == "cpu" else DRAM_TIERS_CUDA

    def effective_write_window_bytes(self, placement: Mapping[str, Mapping[str, str]] | None = None) -> int:
        """The write window the engine would grant: as set, or 2 x the largest NVMe group."""
        if self.write_window_bytes is not None:
            return int(self.write_window_bytes)
        df = self.shards
        if placement is None:
            nvme = df["trainable"].to_numpy(bool)
        else:
            nvme = np.array([placement[n]["optim"] == "nvme" for n in df["shard"]], bool)
        groups = (df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)[nvme]
        return int(2 * groups.max()) if groups.size else 0

    def with_buffers(self, *, prefetch_bytes: int, write_bytes: int, read_ahead_bytes: int, eager: bool) -> "Workload":
        """A copy whose engine settings are the overlap buffers an engine really has (its
        ``Overlap``: under a DRAM budget the engine switches off what does not fit, which the
        config alone does not say): the prefetch window, the window of writes in flight (0:
        synchronous writes), the optimizer read-ahead and the updates during backward."""
        return replace(self, shards=self.shards.copy(), prefetch_bytes=int(prefetch_bytes),
                       write_window_bytes=int(write_bytes),
                       pipeline_read=bool(self.pipeline_read and read_ahead_bytes > 0),
                       updates_during_backward=bool(self.updates_during_backward and eager))

    def with_overhead(self, overhead_s: float) -> "Workload":
        """A copy with :attr:`overhead_s` set (what ``simulator.calibrate`` returns)."""
        return replace(self, shards=self.shards.copy(), overhead_s=float(overhead_s))

    def with_fetch_overhead(self, fetch_overhead_s: float, how: str, *, measured: bool) -> "Workload":
        """A copy with :attr:`fetch_overhead_s` set, whether it was ``measured`` (or assumed), and
        ``source["fetch_overhead"]`` saying where it came from (a planner that knows it from
        elsewhere than this profile read)."""
        return replace(self, shards=self.shards.copy(), fetch_overhead_s=float(fetch_overhead_s),
                       fetch_overhead_measured=bool(measured), source={**self.source, "fetch_overhead": how})

    def with_io_cpu(self, s_per_byte: float, how: str) -> "Workload":
        """A copy with :attr:`io_cpu_s_per_byte` set and ``source["io_cpu"]`` saying how it was had."""
        return replace(self, shards=self.shards.copy(), io_cpu_s_per_byte=max(0.0, float(s_per_byte)),
                       source={**self.source, "io_cpu": how})

    def all_nvme_placement(self) -> dict[str, dict[str, str]]:
        """Every home the planner may move on NVMe, pinned homes where pinned."""
        return self._default_placement("nvme")

    def all_dram_placement(self) -> dict[str, dict[str, str]]:
        """Every home the planner may move in DRAM ("cpu"), pinned homes where pinned."""
        return self._default_placement("cpu")

    def _default_placement(self, tier: str) -> dict[str, dict[str, str]]:
        df = self.shards
        return {name: {"param": pp or tier, "optim": (po or tier) if tr else "none"}
                for name, pp, po, tr in zip(df["shard"].tolist(), df["pin_param"].tolist(), df["pin_optim"].tolist(),
                                            df["trainable"].tolist())}

    def dram_bytes(self, placement) -> int:
        """DRAM bytes of the homes of ``placement`` (param homes + optimizer homes with their
        gradient accumulators), counted as the engine's ``_dram_need`` counts them."""
        p = normalize_placement(self, placement)
        return int(home_dram_bytes(self, [p[n]["param"] for n in self.names], [p[n]["optim"] for n in self.names]).sum())

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]] | pd.DataFrame, *, compute_fwd_s: float,
                  compute_bwd_s: float | None = None, update_s_per_elem: float, **settings) -> "Workload":
        """A workload from plain numbers (tests, what-if studies).

        Each row needs ``numel`` and may give any column of :data:`SHARD_COLUMNS`; defaults: name
        ``s<i>``, kind "param", order = row position, fp32 ``param_bytes = 4 numel``, Adam
        ``optim_bytes = 12 numel``, ``grad_bytes = 4 numel``, one forward and one backward access
        and one update per step, trainable, not a chunk, no pins, both homes "nvme".
        ``compute_bwd_s`` defaults to twice ``compute_fwd_s``. ``settings``: any other field.
        """
        df = pd.DataFrame(list(rows)) if not isinstance(rows, pd.DataFrame) else rows.copy()
        if "numel" not in df.columns:
            raise WorkloadError("Workload.from_rows needs a 'numel' for every shard")
        n = len(df)
        numel = df["numel"].astype("int64")
        defaults: dict[str, Any] = {
            "shard": [f"s{i}" for i in range(n)], "kind": "param", "order": list(range(n)),
            "param_bytes": 4 * numel, "optim_bytes": 12 * numel, "grad_bytes": 4 * numel,
            "chunk": False, "trainable": True, "fwd_accesses_per_step": 1.0, "bwd_accesses_per_step": 1.0,
            "opt_accesses_per_step": 1.0, "unstable": False, "compute_weight": numel.astype(float),
            "pin_param": None, "pin_optim": None, "param_tier": "nvme", "optim_tier": "nvme",
        }
        for col, value in defaults.items():
            if col not in df.columns:
                df[col] = value
            elif isinstance(value, pd.Series):
                df[col] = df[col].where(df[col].notna(), value)
        df["trainable"] = df["trainable"].astype(bool)
        frozen = ~df["trainable"]
        df.loc[frozen, ["optim_bytes", "grad_bytes", "opt_accesses_per_step"]] = 0
        df.loc[frozen, "optim_tier"] = "none"
        df = _typed(df)
        return cls(shards=df, compute_fwd_s=float(compute_fwd_s),
                   compute_bwd_s=float(2 * compute_fwd_s if compute_bwd_s is None else compute_bwd_s),
                   update_s_per_elem=float(update_s_per_elem), **settings)

    @classmethod
    def from_profile(cls, url, run_id: int | None = None, *, last_steps: int = 20, rate: str = "long",
                     short_halflife_steps: float | None = None, long_halflife_steps: float | None = None,
                     unstable_threshold: float | None = None, measure_update_if_needed: bool = True,
                     rate_steps: int | None = None, until_step: int | None = None,
                     measured_update: tuple[float, float] | None = None) -> "Workload":
        """Build the workload of ``run_id`` (default: the newest run) from a profile database.

        ``last_steps``: how many of the newest steps to use (the run's first step is never used)
        for the timings; ``rate_steps`` (default: ``last_steps``): how many for the access rates,
        which do not depend on the placement, so a planner may smooth them over steps from before
        the last migration;
        ``rate``: which smoothed access rate goes into the ``*_accesses_per_step`` columns,
        "long" (the long EWMA, default), "short" or "max" of the two; the halflives and threshold
        are those of :func:`planner.hotness.access_rates`. ``measure_update_if_needed``: time the
        optimizer update here when no shard of the run had both homes in DRAM (else raise);
        ``measured_update``: ``(seconds per element, seconds per update)`` as
        :func:`measure_update` gave them earlier, used instead of timing it again (a planner
        times it once, on the training process, so that its plans do not differ by the noise of
        a new timing, nor by the CPU a planning process gets).
        ``until_step``: read the steps up to that one only (a plan made while training goes on
        reads what there was when it was due).
        """
        from planner import hotness  # hotness imports this module's helpers

        if run_id is None:
            run_id = queries.latest_run_id(url)
            if run_id is None:
                raise WorkloadError(f"no run recorded in {url}; train with the profiler on first")
        info = queries.run_info(url, run_id)
        cfg = load_config(info["config"])
        steps = queries.steps(url, run_id)
        if steps.empty:
            raise WorkloadError(f"run {run_id} has no recorded steps; train a few steps with the profiler on")
        steps = steps.sort_values("step")
        if until_step is not None:
            steps = steps[steps["step"] <= int(until_step)]
            if steps.empty:
                raise WorkloadError(f"run {run_id} has no recorded steps up to step {until_step}; train a few more steps")
        usable = steps[steps["step"] > steps["step"].min()] if len(steps) > 1 else steps
        used = usable.tail(int(last_steps))
        first, last = int(used["step"].min()), int(used["step"].max())

        shards = queries.shards(url, run_id).sort_values("shard_index").reset_index(drop=True)
        if shards.empty:
            raise WorkloadError(f"run {run_id} has no shards recorded")
        kwargs = {k: v for k, v in (("short_halflife_steps", short_halflife_steps), ("long_halflife_steps", long_halflife_steps),
                                    ("unstable_threshold", unstable_threshold)) if v is not None}
        rate_used = used if rate_steps is None else usable.tail(int(rate_steps))
        # a run whose shard detail is sampled (profiler.recorder: "Sampled shard detail") has rows
        # standing for several steps, ending with the sampled one: read those that reach into the
        # rate window, and end its timeline with the newest step a row covers (the steps after the
        # last sample are not unused, only not yet recorded)
        ss = queries.shard_steps(url, run_id, first_step=int(rate_used["step"].min()), last_step=last, covering=True)
        rate_timeline = rate_used["step"].tolist()
        if len(ss):
            covered = int((ss["step"] + ss["window_steps"].clip(lower=1) - 1).max())
            rate_timeline = [s for s in rate_timeline if s <= covered] or rate_timeline
        rates = hotness.access_rates(ss, shards["name"].tolist(), steps=rate_timeline, **kwargs).set_index("shard")
        stats = queries.shard_access_stats(url, run_id, first_step=first, last_step=last).set_index("name")

        def pick(phase: str) -> pd.Series:
            s, lg = rates[f"{phase}_short"], rates[f"{phase}_long"]
            return {"long": lg, "short": s, "max": np.maximum(s, lg)}[rate]

        if rate not in ("long", "short", "max"):
            raise WorkloadError(f"rate must be 'long', 'short' or 'max', got {rate!r}")
        zero = cfg.zero_optimization
        param_pins = PinSet.from_config(zero.offload_param.module_parameters)
        optim_pins = PinSet.from_config(zero.offload_optimizer.module_parameters)
        names = shards["name"]
        members = shards["members"].map(lambda m: list(m) if m is not None else [])
        trainable = shards["optim_bytes"].astype("int64") > 0
        df = pd.DataFrame({
            "shard": names,
            "kind": shards["kind"],
            "order": shards["shard_index"].astype("int64"),
            "numel": shards["numel"].astype("int64"),
            "param_bytes": shards["param_bytes"].astype("int64"),
            "optim_bytes": shards["optim_bytes"].astype("int64"),
            "grad_bytes": shards["grad_bytes"].astype("int64"),
            # held for the whole pass: a packed chunk of several parameters (the members column
            # lists names, and a tied parameter has several names, so the name says it)
            "chunk": names.str.match(r"^chunk\d+:") & (members.map(len) > 1),
            "trainable": trainable,
            "fwd_accesses_per_step": pick("fwd").reindex(names).to_numpy(),
            "bwd_accesses_per_step": (pick("bwd") + pick("rec")).reindex(names).to_numpy(),
            "opt_accesses_per_step": pick("opt").reindex(names).clip(upper=1.0).to_numpy(),
            "unstable": rates["unstable"].reindex(names).to_numpy(),
            "compute_weight": shards["numel"].astype(float),
            # all phases under each EWMA whichever ``rate`` fills the columns above: a planner
            # comparing accesses across plans compares like with like (not a 2-step EWMA with a
            # 16-step one, whose difference is mostly the short one's noise)
            "accesses_short": rates["accesses_short"].reindex(names).to_numpy(),
            "accesses_long": rates["accesses_long"].reindex(names).to_numpy(),
            "accesses_max": rates["accesses_max"].reindex(names).to_numpy(),
            "pin_param": [_pin(param_pins, m) for m in members],
            "pin_optim": [_pin(optim_pins, m) if t else None for m, t in zip(members, trainable)],
            "param_tier": stats["param_tier"].reindex(names).to_numpy(),
            "optim_tier": stats["optim_tier"].reindex(names).to_numpy(),
        })
        df = _typed(df)

        # -- step-level numbers (medians over the steps used)
        med = {c: float(used[c].median()) for c in ("wall_s", "forward_s", "backward_s", "optimizer_s", "stall_s")}
        nvme_moved = used["read_nvme_bytes"] + used["written_nvme_bytes"]
        fb = used["forward_s"] + used["backward_s"]
        compute_frac = ((fb - used["stall_s"]).clip(lower=0) / fb.where(fb > 0)).fillna(1.0)
        compute_fwd_s = float((used["forward_s"] * compute_frac).median())
        compute_bwd_s = float((used["backward_s"] * compute_frac).median())
        micro = int(used["micro_batches"].median()) if "micro_batches" in used else int(cfg.gradient_accumulation_steps)

        device = _device_of(cfg, info)
        dtype_bytes = int(df["param_bytes"].sum() / max(1, df["numel"].sum())) or 4
        source: dict[str, Any] = {"url": str(url), "run_id": int(run_id), "steps": [first, last], "n_steps": int(len(used)),
                                  "rate": rate, "compute_split": "same stall fraction in forward and backward"}

        update_s_per_elem, update_overhead_s, how = _update_cost(stats, cfg, measure_update_if_needed, measured_update)
        source["update"] = how
        # (fp16: an update may run only once no gradient of the step overflowed, so none during backward)
        eager = bool(cfg.zinf.overlap_optimizer and cfg.gradient_clipping == 0 and not cfg.fp16.enabled)
        fetch_overhead_s, fetch_measured, how = _fetch_overhead(stats, df.set_index("shard"), micro, eager)
        source["fetch_overhead"] = how
        copy_Bps, copy_measured = math.inf, False
        if device == "cuda":
            copy_Bps, copy_measured, how = _copy_bandwidth(stats)
            source["copy"] = how

        off_param, off_opt = zero.offload_param, zero.offload_optimizer
        prefetch_bytes = int(min(zero.stage3_prefetch_bucket_size, off_param.buffer_count * off_param.buffer_size) * dtype_bytes)
        fp32 = dtype_bytes == 4
        same_store = str(cfg.param_nvme_path) == str(cfg.optim_nvme_path)
        wl = cls(
            shards=df,
            compute_fwd_s=compute_fwd_s,
            compute_bwd_s=compute_bwd_s,
            update_s_per_elem=update_s_per_elem,
            update_overhead_s=update_overhead_s,
            fetch_overhead_s=fetch_overhead_s,
            fetch_overhead_measured=fetch_measured,
            copy_Bps=copy_Bps,
            copy_measured=copy_measured,
            micro_batches=micro,
            prefetch_bytes=prefetch_bytes,
            reuse_distance_bytes=int(zero.stage3_max_reuse_distance * dtype_bytes),
            pipeline_read=bool(off_opt.pipeline_read),
            write_window_bytes=None if off_opt.pipeline_write else 0,
            updates_during_backward=eager,
            dram_updates_during_backward=eager and device == "cuda",
            param_file_is_master=fp32 and same_store,
            aliases_master=fp32,
            device=device,
            disk_servers=max(2, int(cfg.aio.thread_count)),
            cpu_contention=1.0 if device == "cpu" else 0.0,
            measured_step_s=med["wall_s"],
            io_cpu_base_bytes=float(nvme_moved.median()),
            measured=med,
            measured_placement={n: {"param": str(p), "optim": str(o)} for n, p, o in zip(df["shard"], df["param_tier"], df["optim_tier"])},
            source=source,
        )
        wl.reserved_dram_bytes = engine_reserved_bytes(
            wl, staging_bytes=int(cfg.zinf.staging_buffers * cfg.zinf.staging_buffer_size),
            eager=wl.updates_during_backward)
        return wl


# ---------------------------------------------------------------------------------- helpers
def _typed(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    for c in ("order", "numel", "param_bytes", "optim_bytes", "grad_bytes"):
        df[c] = pd.to_numeric(df[c]).astype("int64")
    for c in ("fwd_accesses_per_step", "bwd_accesses_per_step", "opt_accesses_per_step", "compute_weight"):
        df[c] = pd.to_numeric(df[c]).fillna(0.0).astype("float64")
    for c in ("chunk", "trainable", "unstable"):
        df[c] = df[c].fillna(False).astype(bool)
    for c in ("pin_param", "pin_optim"):
        df[c] = df[c].astype("object").where(df[c].notna(), None)
    for c in ("param_tier", "optim_tier"):
        df[c] = df[c].astype("object")
    return df[SHARD_COLUMNS + [c for c in df.columns if c not in SHARD_COLUMNS]]


def _pin(pins, members: list[str]) -> str | None:
    if not pins or not members:
        return None
    device = pins.tier_for_param(members[0])
    return _DEVICE_TO_TIER.get(device) if device else None


def _device_of(cfg, info: Mapping[str, Any]) -> str:
    want = cfg.zinf.device
    if want == "cuda":
        return "cuda"
    if want == "cpu":
        return "cpu"
    hw = info.get("hardware") or {}
    return "cuda" if hw.get("gpu") else "cpu"


def home_dram_bytes(workload: Workload, param_tiers, optim_tiers) -> np.ndarray:
    """DRAM bytes of each shard's homes for the given tiers (arrays in shard order).

    The engine's rule (``Engine._dram_need``): a param home in a DRAM tier costs ``param_bytes``,
    except when it aliases the master (fp32, both homes in DRAM: one tensor); an
    optimizer home in a DRAM tier costs ``optim_bytes + grad_bytes`` (master, moments, gradient).
    """
    df = workload.shards
    dram = workload.dram_tiers
    p_dram = np.isin(np.asarray(param_tiers, dtype=object), dram)
    o_dram = np.isin(np.asarray(optim_tiers, dtype=object), dram)
    param = df["param_bytes"].to_numpy(np.int64)
    optim = (df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)
    trainable = df["trainable"].to_numpy(bool)
    aliased = workload.aliases_master & p_dram & o_dram & trainable
    return np.where(p_dram & ~aliased, param, 0) + np.where(o_dram & trainable, optim, 0)


def engine_reserved_bytes(workload: Workload, *, staging_bytes: int = 4 * (4 << 20), eager: bool | None = None,
                          prefetch_bytes: int | None = None) -> int:
    """DRAM the engine needs besides the homes, at the all-NVMe placement (an upper bound for any
    placement: every term shrinks as homes move to DRAM). Mirrors ``Engine._dram_need`` and
    ``Engine._size_overlap``:

    * working set: the largest NVMe group with its gradient twice (``optim + 2 grad``), the
      gradients of NVMe chunks (they wait for the end of backward), and on a CPU device the params
      materialised at once - estimated as the chunks (held for the whole pass) plus twice the
      largest other param (a module and its parent; the profile does not record the module tree);
    * staging buffers (``staging_bytes``) when anything is on NVMe;
    * overlap wanted: 2 groups of writes in flight, 1 group read ahead, 3 groups for updates during
      backward (when on), and the prefetch window.
    """
    df = workload.shards
    eager = workload.updates_during_backward if eager is None else eager
    prefetch_bytes = workload.prefetch_bytes if prefetch_bytes is None else prefetch_bytes
    trainable = df["trainable"].to_numpy(bool)
    group = (df["optim_bytes"] + 2 * df["grad_bytes"]).to_numpy(np.int64)[trainable]
    largest_group = int(group.max()) if group.size else 0
    chunk = df["chunk"].to_numpy(bool)
    chunk_grads = int(df["grad_bytes"].to_numpy(np.int64)[chunk & trainable].sum())
    working = largest_group + chunk_grads
    if workload.device == "cpu":
        p = df["param_bytes"].to_numpy(np.int64)
        working += int(p[chunk].sum()) + 2 * int(p[~chunk].max() if (~chunk).any() else 0)
    optim_group = int((df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)[trainable].max()) if trainable.any() else 0
    overlap = (2 + 1 + (3 if eager else 0)) * optim_group + int(prefetch_bytes)
    return int(working + staging_bytes + overlap)


def normalize_placement(workload: Workload, placement) -> dict[str, dict[str, str]]:
    """``placement`` as {shard: {"param": tier, "optim": tier}} for every shard of ``workload``.

    Accepts the engine's form ({name: {"param": ..., "optim": ...}}), {name: (param, optim)}, or
    {(name, state): tier}; shards not mentioned keep their all-NVMe default (pins respected).
    """
    out = workload.all_nvme_placement()
    if placement is None:
        return out
    for key, value in placement.items():
        if isinstance(key, tuple):
            name, state = key
            if name not in out:
                raise WorkloadError(f"placement names unknown shard {name!r}")
            out[name] = {**out[name], state: value}
            continue
        if key not in out:
            raise WorkloadError(f"placement names unknown shard {key!r}")
        if isinstance(value, Mapping):
            out[key] = {"param": value.get("param", out[key]["param"]), "optim": value.get("optim", out[key]["optim"])}
        else:
            param, optim = value
            out[key] = {"param": param, "optim": optim}
    return out


def measure_update(optimizer_config=None, *, numel: int = 1 << 18, repeats: int = 9) -> tuple[float, float]:
    """Time zinf's own optimizer update (``zinf.optim``, AdamW by default) on this machine:
    ``(seconds per element, seconds of a 1024-element update)``, the fastest of ``repeats`` runs
    each (the minimum: other processes only ever add time). 256 Ki elements is a typical one-MiB
    shard; much larger tensors fall out of cache and run up to 2x slower per element."""
    import torch

    from zinf.config import OptimizerConfig
    from zinf.optim import OptimizerSpec

    spec = OptimizerSpec.from_config(optimizer_config or OptimizerConfig())

    def once(n: int) -> float:
        p = torch.randn(n)
        g = torch.randn(n)
        state = {k: torch.zeros(n) for k in spec.state_names}
        best = math.inf
        for i in range(repeats):
            t0 = time.perf_counter()
            spec.update(p, g, state, i + 1)
            best = min(best, time.perf_counter() - t0)
        return best

    small = once(1024)
    big = once(numel)
    return max(0.0, (big - small) / (numel - 1024)), small


@dataclass(frozen=True)
class IoCpuTiming:
    """What :func:`measure_io_cpu` measured."""

    alone_s: float
    """Seconds of the compute loop alone (the fastest of the repeats)."""
    beside_s: float
    """Seconds of the same loop while the store reads."""
    read_Bps: float
    """Bytes/s the store read meanwhile."""

    @property
    def s_per_byte(self) -> float:
        """Compute seconds lost per byte read (0 when reading cost the compute nothing)."""
        if self.read_Bps <= 0 or self.beside_s <= self.alone_s:
            return 0.0
        return (self.beside_s - self.alone_s) / (self.read_Bps * self.beside_s)


def measure_io_cpu(directory, *, thread_count: int = 4, target_s: float = 0.1, repeats: int = 3,
                   shard_numel: int = 1 << 18) -> IoCpuTiming:
    """Time a torch matmul loop (the training thread's kind of work) alone, then while an
    :class:`~zinf.storage.nvme.NvmeStore` in a temporary folder of ``directory`` reads 1 MiB
    files back to back, four at a time (as a prefetch does), on ``thread_count`` request threads.
    The fastest of ``repeats`` timings of ~``target_s`` each counts. About ``6 x target_s`` plus
    writing 16 MiB; the folder is removed."""
    import tempfile
    import threading

    import torch

    from zinf.storage.nvme import NvmeStore

    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(256, 256, generator=gen), torch.randn(256, 1024, generator=gen)

    def loop(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            (a @ w) @ w.T
        return time.perf_counter() - t0

    n = max(1, int(target_s / max(loop(8) / 8, 1e-6)))
    files, in_flight = 16, 4
    with tempfile.TemporaryDirectory(dir=directory, prefix="zinf-io-cpu-") as d:
        store = NvmeStore(d, run_name="io-cpu", staging_bytes=1 << 20, thread_count=thread_count)
        try:
            t = torch.randn(shard_numel, generator=gen)
            for i in range(files):
                store.write(f"k{i}", t)
            alone = min(loop(n) for _ in range(repeats))
            stop, read = threading.Event(), [0]

            def reader() -> None:
                outs = [torch.empty(shard_numel) for _ in range(in_flight)]
                i = 0
                while not stop.is_set():
                    futures = [store.read_async(f"k{(i + j) % files}", outs[j]) for j in range(in_flight)]
                    for f in futures:
                        f.result()
                    read[0] += in_flight * shard_numel * 4
                    i += in_flight

            thread = threading.Thread(target=reader, daemon=True)
            thread.start()
            try:
                time.sleep(target_s / 2)  # the reads under way
                t0, b0 = time.perf_counter(), read[0]
                beside = min(loop(n) for _ in range(repeats))
                deadline = time.perf_counter() + 10.0
                while read[0] == b0 and time.perf_counter() < deadline:  # (a starved reader: its first batch)
                    time.sleep(0.001)
                elapsed, nbytes = time.perf_counter() - t0, read[0] - b0
            finally:
                stop.set()
                thread.join()
        finally:
            store.close()
    return IoCpuTiming(alone_s=alone, beside_s=beside, read_Bps=nbytes / elapsed if elapsed > 0 else 0.0)


def _update_cost(stats: pd.DataFrame, cfg, measure: bool,
                 measured: tuple[float, float] | None = None) -> tuple[float, float, str]:
    """(s per element, s per update, how): fitted on the updates the engine timed (``update_s``,
    every shard updated), else - a profile older than schema 0003 - on the shards with both
    homes in DRAM (their ``optimizer_s`` is the update alone), else ``measured``, else measured
    here."""
    from planner.costmodel import fit_latency_bandwidth

    updated = stats[stats["optimizer_accesses"] > 0]
    if "update_s" in updated and updated["update_s"].sum() > 0:
        rows, seconds, which = updated[updated["update_s"] > 0], "update_s", "shards' recorded updates"
    else:
        dram = ("cpu", "gpu")
        rows = updated[updated["optim_tier"].isin(dram) & updated["param_tier"].isin(dram)]
        seconds, which = "optimizer_s", "shards with both homes in DRAM"
    if len(rows) >= 2:
        numel = rows["numel"].to_numpy(np.float64)
        per_update = (rows[seconds] / rows["optimizer_accesses"]).to_numpy(np.float64)
        try:
            overhead_s, elems_per_s, method = fit_latency_bandwidth(numel, per_update)
            return 1.0 / elems_per_s, overhead_s, f"fitted on {len(rows)} {which} ({method})"
        except ZinfError:
            pass
    if len(rows) >= 1:
        s = float(rows[seconds].sum() / (rows["numel"] * rows["optimizer_accesses"]).sum())
        return s, 0.0, f"ratio over {len(rows)} {which}"
    if measured is not None:
        return float(measured[0]), float(measured[1]), \
            "measured before (zinf.optim on 256 Ki elements): no shard had both homes in DRAM"
    if not measure:
        raise WorkloadError("no shard had both homes in DRAM, so the profile cannot tell update seconds from I/O waits; "
                            "pass measure_update_if_needed=True or give update_s_per_elem")
    s, small = measure_update(cfg.optimizer)
    return s, small, "measured here (zinf.optim on 256 Ki elements): no shard had both homes in DRAM"


def _fetch_overhead(stats: pd.DataFrame, df: pd.DataFrame, micro: int, eager: bool) -> tuple[float, bool, str]:
    """Seconds of an NVMe param fetch beyond its read, whether any fetch measured it, and how.

    The engine records it (``fetch_overhead_s``: resizing the storage, copying out of the read
    buffer or launching the upload): the median over one-parameter NVMe shards of their overhead
    per fetch. Profiles older than schema 0003 hold 0 there: then the 25th percentile of stall per
    fetch (a guess that a quarter of fetches find their prefetch landed; too high where stall_s
    also holds gradient read-backs, or where nothing is prefetched). (0, False) without any fetch."""
    rows = stats[(stats["param_tier"] == "nvme")]
    if rows.empty:
        return 0.0, False, "no NVMe param shard: 0"
    # recorded by this engine: some overhead, or (every fetch uploaded ahead on CUDA, 0 at each)
    # the update seconds that the same schema records; an older profile upgraded has 0 in both
    recorded = "fetch_overhead_s" in rows and (rows["fetch_overhead_s"].sum() > 0 or stats["update_s"].sum() > 0)
    per = []
    for name, r in rows.iterrows():
        if df.loc[name, "chunk"] or r["param_bytes"] <= 0:
            continue
        # param bytes read = every NVMe byte read minus the optimizer group's (and gradient's) reads
        group = 0.0
        if r["optim_tier"] == "nvme" and r["optimizer_accesses"] > 0:
            steps = max(1, int(r["steps"]))
            grads_per_step = min(micro, r["backward_accesses"] / steps)  # micro-batches with a gradient
            readbacks = max(0.0, grads_per_step - 1) * steps  # sums read back between micro-batches
            group = r["optimizer_accesses"] * (r["optim_bytes"] + (0 if eager else r["grad_bytes"])) + readbacks * r["grad_bytes"]
        # (on CUDA a fetch uploaded ahead counts here too, with no overhead at the fetch)
        fetches = max(0.0, (r["read_nvme_bytes"] - group)) / r["param_bytes"]
        if fetches >= 1:
            per.append((r["fetch_overhead_s"] if recorded else r["stall_s"]) / fetches)
    if not per:
        return 0.0, False, "no NVMe param fetch recorded: 0"
    if recorded:
        return float(np.median(per)), True, f"recorded overhead per fetch, median over {len(per)} NVMe param shards"
    return float(np.quantile(per, 0.25)), True, f"25th percentile of stall per fetch over {len(per)} NVMe param shards (profile before schema 0003)"


def _copy_bandwidth(stats: pd.DataFrame) -> tuple[float, bool, str]:
    """Bytes/s the training thread pays to put a DRAM param on the GPU, whether any fetch measured
    it, and how: bytes over the seconds its fetches took (``fetch_s``; not ``stall_s``, which
    also holds the shard's gradient read-backs and write waits). The upload runs on a side
    stream, so this is mostly launching it."""
    rows = stats[(stats["param_tier"] == "cpu") & (stats["read_cpu_bytes"] > 0)]
    if rows.empty:
        return 25e9, False, "no DRAM param fetch recorded: 25 GB/s assumed (pinned host to device)"
    seconds = float(rows["fetch_s"].sum())
    if seconds <= 0:
        return math.inf, True, f"no wait in the fetches of {len(rows)} DRAM param shards: free"
    return float(rows["read_cpu_bytes"].sum() / seconds), True, f"bytes / fetch seconds over {len(rows)} DRAM param shards"
