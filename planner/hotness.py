"""Hotness: how often each shard is used (smoothed), and what it costs to keep it on NVMe.

Two things live here.

**Access rates** (:func:`access_rates`). The profile's ``shard_steps`` rows count a shard's
accesses per phase per window of steps; a shard with no row in a step was not accessed in it (an
idle expert), so it counts 0 there, never "unknown". Each phase's accesses per step are smoothed by
two exponentially weighted moving averages over the steps in order::

    s_1 = x_1,   s_t = s_{t-1} + alpha * (x_t - s_{t-1}),   alpha = 1 - 2 ** (-1 / halflife_steps)

a short one (reacts within a few steps: routing drift) and a long one (what the shard does on
average). The recursion starts at the first step, which therefore weighs as much as all the steps
before it would have; :func:`ewma_weights` gives each step's weight and
:func:`ewma_effective_steps` / :func:`ewma_difference_steps` the steps that much noise averages
(for the planner's noise tests). A shard is ``unstable`` when they disagree: ``|short - long| > threshold * max(short,
long)`` for its total accesses, and the larger is at least ``min_accesses`` (so that 0.01 vs 0.02
does not count). The planner should not trust the placement of an unstable shard much (the policy
can keep it where it is).

**Stall cost** (:func:`stall_cost`): hotness is stall cost, not hit count. For every shard, the
seconds per step the *compute waits* because its param (resp. its optimizer group) lives on NVMe
rather than in DRAM, given its bytes, its accesses, the cost model, and the slack before it is
needed. This is the *linearised* model - each state is costed alone, against the all-NVMe
placement (pins kept), ignoring queueing on the disk - used as the MILP's objective and as the
greedy solver's first guess; the simulator (:mod:`planner.simulator`) is the full model.

* Param on NVMe: every access that needs a read (a one-parameter shard: each forward and each
  backward access; a chunk: once per pass, it is held for the pass) costs ``max(0, read_s -
  slack_s) + fetch_overhead_s``, where ``read_s = latency + param_bytes / bandwidth`` (read) and
  ``slack_s`` is the compute between the moment the prefetcher can issue the read and the moment
  it is needed: the prefetcher keeps ``prefetch_bytes`` of reads in flight along the trace, so the
  read of an entry is issued when the entry ``prefetch_bytes`` earlier in the NVMe trace is taken;
  the slack is the compute of the accesses between the two (``0`` without a window, and for a
  forward access of a shard used in fewer than ``MIN_USE_RATE`` of the passes: the prefetcher
  reads those when needed, ``zinf/prefetch.py``). Keeping a
  released param for its backward use (``stage3_max_reuse_distance``) is not modelled here: every
  backward access of a one-parameter shard counts as a read. A param rewrite after an update
  (param on NVMe in its own file) costs only when writes are synchronous (no write window).
* Optimizer group on NVMe: per update, the group read (master + moments, + gradient when it was
  spilled) exposed beyond its slack (the update of the group before it with ``pipeline_read``, or
  the backward compute of its module and the next when updates run during backward; 0 otherwise), the write-back
  when writes are synchronous, and with gradient accumulation the gradient read back (synchronous)
  between micro-batches.

``saved_s_per_byte`` is that cost divided by the DRAM bytes the home would take (see
:func:`planner.workload.home_dram_bytes`): the density a knapsack over the DRAM budget ranks by.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from zinf.prefetch import MIN_USE_RATE

from planner.workload import Workload

__all__ = ["access_rates", "ewma", "ewma_weights", "ewma_effective_steps", "ewma_difference_steps", "stall_cost", "io_costs", "PHASES", "IoCosts"]

PHASES = {"fwd": "forward_accesses", "bwd": "backward_accesses", "rec": "recompute_accesses", "opt": "optimizer_accesses"}
"""Short phase names used in column names -> the ``shard_steps`` columns they come from."""


# ------------------------------------------------------------------------------ access rates
def _alpha(halflife_steps: float) -> float:
    """The EWMA's step weight for this halflife: ``1 - 2 ** (-1 / halflife_steps)``."""
    return 1.0 - 2.0 ** (-1.0 / float(halflife_steps))


def ewma_weights(halflife_steps: float, steps: int) -> np.ndarray:
    """The weights (oldest step first, summing to 1) that :func:`ewma` gives the steps of a
    series ``steps`` long: ``alpha (1 - alpha) ** age`` for each step after the first, and the
    rest, ``(1 - alpha) ** (steps - 1)``, for the first (the recursion starts at it). The first
    step of a short series therefore weighs as much as all the steps before it would have: 30% of
    a 15-step series at an 8-step halflife, 65% of an 11-step one at 16. The noise model must
    count that (:func:`ewma_effective_steps`). Normalising the weights instead (every step by its
    age alone) was measured: the MoE benchmark's first plans then came out 15% slower at 30%
    (benchmarks/RESULTS.md, eighth run), so the rates stay as they are."""
    alpha = _alpha(max(float(halflife_steps), 1e-9))
    n = max(1, int(steps))
    w = alpha * (1.0 - alpha) ** np.arange(n - 1, -1, -1, dtype=np.float64)
    w[0] = (1.0 - alpha) ** (n - 1)
    return w


def ewma(x: np.ndarray, halflife_steps: float) -> np.ndarray:
    """The EWMA of ``x`` (steps along axis 0) after its last step: ``s_1 = x_1``, ``s_t = s_{t-1}
    + alpha (x_t - s_{t-1})`` with ``alpha = 1 - 2 ** (-1 / halflife_steps)`` (the weights of
    :func:`ewma_weights`)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[0] == 0:
        return np.zeros(x.shape[1:])
    # the recursion, not ewma_weights @ x: a constant series stays exactly constant, so a dense
    # shard's short and long EWMAs are equal and the planner's noise tests leave it out
    alpha = _alpha(halflife_steps)
    s = x[0].copy()
    for t in range(1, x.shape[0]):
        s += alpha * (x[t] - s)
    return s


def ewma_effective_steps(halflife_steps: float, steps: int | None = None) -> float:
    """How many independent steps an EWMA with this halflife averages (the variance of one step
    over this is the EWMA's): ``1 / sum(w ** 2)`` over :func:`ewma_weights` of a series ``steps``
    long - 2.3 for 11 steps at a 16-step halflife, whose first step weighs 65% (``min(steps,
    (2 - alpha) / alpha)`` said 11, and the noise model saw routing changes in noise); without
    ``steps``, of an endless one: ``(2 - alpha) / alpha``."""
    if steps is None:
        alpha = _alpha(max(float(halflife_steps), 1e-9))
        return (2.0 - alpha) / alpha
    return float(1.0 / np.sum(ewma_weights(halflife_steps, steps) ** 2))


def ewma_difference_steps(halflife_a: float, halflife_b: float, steps: int) -> float:
    """The effective steps of the difference of two EWMAs (halflives ``halflife_a`` and
    ``halflife_b``) of the same series ``steps`` long: ``1 / sum((w_a - w_b) ** 2)`` (the
    variance of one step over this is the difference's). The two share the newest steps, so their
    difference varies less than the two variances added: 0.6-0.8 of it for a quarter-period
    and a two-period EWMA; inf when both weigh the steps alike."""
    ss = float(np.sum((ewma_weights(halflife_a, steps) - ewma_weights(halflife_b, steps)) ** 2))
    return 1.0 / ss if ss > 0 else math.inf


def access_rates(shard_steps: pd.DataFrame, shards: Sequence[str] | pd.DataFrame, steps: Iterable[int] | None = None, *,
                 short_halflife_steps: float = 2.0, long_halflife_steps: float = 10.0,
                 unstable_threshold: float = 0.5, min_accesses: float = 0.5) -> pd.DataFrame:
    """Smoothed accesses per step of every shard in ``shards``.

    ``shard_steps``: rows as :func:`profiler.queries.shard_steps` returns them (``step,
    window_steps, name`` and the ``*_accesses`` columns); a window of ``w`` steps spreads its
    counts evenly over its steps. ``steps``: the step numbers, in order, that make the timeline
    (default: every step the rows cover); a shard without a row in a step has 0 accesses there.

    Returns one row per shard: ``shard``, for each phase in :data:`PHASES` ``<phase>_short`` and
    ``<phase>_long`` (accesses per step), ``accesses_short``/``accesses_long`` (all phases),
    ``accesses_last`` (the last step's), ``accesses_max`` (the most in one step of the timeline:
    a routed expert's accesses are capped there - hit or not in each micro-batch - so a shard at
    its cap does not vary, which a noise model must know), ``unstable``.
    """
    names = list(shards["name"] if isinstance(shards, pd.DataFrame) and "name" in shards else
                 shards["shard"] if isinstance(shards, pd.DataFrame) else shards)
    col_of = {n: i for i, n in enumerate(names)}
    rows = shard_steps if shard_steps is not None else pd.DataFrame()
    if steps is None:
        if len(rows):
            w = rows["window_steps"] if "window_steps" in rows else pd.Series(1, index=rows.index)
            lo, hi = int(rows["step"].min()), int((rows["step"] + w - 1).max())
            steps = list(range(lo, hi + 1))
        else:
            steps = []
    steps = [int(s) for s in steps]
    row_of = {s: i for i, s in enumerate(steps)}
    T, S = len(steps), len(names)
    mats = {p: np.zeros((T, S)) for p in PHASES}
    if len(rows) and T:
        win = rows["window_steps"].to_numpy(np.int64) if "window_steps" in rows else np.ones(len(rows), np.int64)
        first = rows["step"].to_numpy(np.int64)
        cols = rows["name"].map(col_of)
        known = cols.notna().to_numpy()
        for p, src in PHASES.items():
            vals = rows[src].to_numpy(np.float64) if src in rows else np.zeros(len(rows))
            for k in np.flatnonzero(known):
                w = max(1, int(win[k]))
                for s in range(int(first[k]), int(first[k]) + w):
                    t = row_of.get(s)
                    if t is not None:
                        mats[p][t, int(cols.iloc[k])] += vals[k] / w
    out = pd.DataFrame({"shard": names})
    total_short = np.zeros(S)
    total_long = np.zeros(S)
    for p, m in mats.items():
        out[f"{p}_short"] = ewma(m, short_halflife_steps)
        out[f"{p}_long"] = ewma(m, long_halflife_steps)
        total_short += out[f"{p}_short"].to_numpy()
        total_long += out[f"{p}_long"].to_numpy()
    out["accesses_short"] = total_short
    out["accesses_long"] = total_long
    out["accesses_last"] = sum(m[-1] for m in mats.values()) if T else np.zeros(S)
    out["accesses_max"] = sum(mats.values()).max(axis=0) if T else np.zeros(S)
    big = np.maximum(total_short, total_long)
    out["unstable"] = (np.abs(total_short - total_long) > unstable_threshold * big) & (big >= min_accesses)
    return out


# ------------------------------------------------------------------------------- I/O costs
class IoCosts:
    """Per-request latency and bandwidth of NVMe reads and writes, taken from a cost model
    (``nvme``/``read`` and ``nvme``/``write``; a missing direction borrows the other's).

    ``read_Bps`` / ``write_Bps`` are a request's bandwidth at the concurrency the samples were
    taken at (what the linear stall cost uses); the simulator, which knows how many requests are in
    flight, uses ``*_alone_s_per_byte`` (a request with the disk to itself) plus
    ``*_shared_s_per_byte`` for every other request in flight (:mod:`planner.costmodel`).
    """

    def __init__(self, cost_model) -> None:
        from planner.costmodel import CostModelError

        try:
            r = cost_model.cost("nvme", "read")
        except CostModelError:
            r = None
        try:
            w = cost_model.cost("nvme", "write")
        except CostModelError:
            w = None
        if r is None and w is None:
            cost_model.cost("nvme", "read")  # raises the cost model's own error, naming the fix
        r = r or w
        w = w or r
        self.read_latency_s, self.write_latency_s = float(r.latency_s), float(w.latency_s)
        self.read_alone_s_per_byte, self.write_alone_s_per_byte = 1.0 / float(r.bandwidth_Bps), 1.0 / float(w.bandwidth_Bps)
        self.read_shared_s_per_byte = float(getattr(r, "shared_s_per_byte", 0.0))
        self.write_shared_s_per_byte = float(getattr(w, "shared_s_per_byte", 0.0))
        r_c, w_c = float(getattr(r, "concurrency", 1.0)), float(getattr(w, "concurrency", 1.0))
        self.read_Bps = 1.0 / (self.read_alone_s_per_byte + max(0.0, r_c - 1.0) * self.read_shared_s_per_byte)
        self.write_Bps = 1.0 / (self.write_alone_s_per_byte + max(0.0, w_c - 1.0) * self.write_shared_s_per_byte)

    def read_s(self, nbytes, requests=1):
        return requests * self.read_latency_s + np.asarray(nbytes, dtype=np.float64) / self.read_Bps

    def write_s(self, nbytes, requests=1):
        return requests * self.write_latency_s + np.asarray(nbytes, dtype=np.float64) / self.write_Bps


def io_costs(cost_model) -> IoCosts:
    """:class:`IoCosts` of ``cost_model`` (or ``cost_model`` itself if it already is one)."""
    return cost_model if isinstance(cost_model, IoCosts) else IoCosts(cost_model)


# ------------------------------------------------------------------------------ stall cost
def stall_cost(workload: Workload, cost_model, *, prefetch_bytes: int | None = None) -> pd.DataFrame:
    """The linearised stall cost of each shard's param and optimizer group on NVMe (see the module
    docstring), against the all-NVMe placement. One row per shard, in order:

    ``shard, param_reads_per_step, param_read_s`` (one read), ``param_slack_s`` (mean over its
    reads), ``param_stall_s`` (per step), ``param_disk_s`` (disk seconds per step),
    ``optim_stall_s``, ``optim_disk_s``, ``param_dram_bytes``, ``optim_dram_bytes``,
    ``param_saved_s_per_byte``, ``optim_saved_s_per_byte``, ``param_movable``, ``optim_movable``.
    """
    io = io_costs(cost_model)
    wl = workload
    df = wl.shards
    k = max(1, int(wl.micro_batches))
    W = wl.prefetch_bytes if prefetch_bytes is None else int(prefetch_bytes)
    n = len(df)
    P = df["param_bytes"].to_numpy(np.float64)
    O = df["optim_bytes"].to_numpy(np.float64)
    G = df["grad_bytes"].to_numpy(np.float64)
    numel = df["numel"].to_numpy(np.float64)
    chunk = df["chunk"].to_numpy(bool)
    trainable = df["trainable"].to_numpy(bool)
    wf = df["fwd_accesses_per_step"].to_numpy(np.float64) / k  # uses per pass
    wb = df["bwd_accesses_per_step"].to_numpy(np.float64) / k
    uo = np.clip(df["opt_accesses_per_step"].to_numpy(np.float64), 0.0, 1.0)
    c_f, c_b = _per_access_compute(wl)  # seconds per pass of each shard's forward / backward uses

    # -- param: the NVMe trace of one pass at the all-NVMe placement (pins kept)
    # (an unpinned param is on NVMe there and movable; a pinned one stays at its pin)
    pin_p = df["pin_param"]
    movable_p = pin_p.isna().to_numpy()
    param_nvme = movable_p | (pin_p == "nvme").to_numpy()
    in_trace = param_nvme  # the shards whose reads would be in the trace
    # records of a pass: forward in order, then backward in reverse order
    fwd_rec = np.flatnonzero(wf > 0)
    bwd_rec = np.flatnonzero(wb > 0)[::-1]
    rec_shard = np.concatenate([fwd_rec, bwd_rec])
    rec_compute = np.concatenate([c_f[fwd_rec], c_b[bwd_rec]])
    rec_is_bwd = np.concatenate([np.zeros(len(fwd_rec), bool), np.ones(len(bwd_rec), bool)])
    compute_before = np.concatenate([[0.0], np.cumsum(rec_compute)])[:-1]
    reads_w = np.where(rec_is_bwd, np.minimum(wb[rec_shard], 1.0), np.minimum(wf[rec_shard], 1.0))
    is_entry = in_trace[rec_shard] & ~(rec_is_bwd & chunk[rec_shard])
    entries = np.flatnonzero(is_entry)
    e_bytes = P[rec_shard[entries]] * reads_w[entries]
    # As zinf/prefetch.py: the shards the forward uses in at least MIN_USE_RATE of the passes are
    # read ahead along the trace; the others' forward entries are read when needed (no slack, no
    # window), their backward ones issued once backward starts (the forward's compute is over)
    often = np.minimum(wf[rec_shard[entries]], 1.0) >= MIN_USE_RATE
    e_bwd = rec_is_bwd[entries]
    largest = float(P[in_trace].max()) if in_trace.any() else 0.0
    window = W if W >= largest else 0  # the engine turns prefetch off when the largest read would not fit
    slack = np.zeros(len(entries))
    if window > 0 and len(entries):
        cb = np.concatenate([[0.0], np.cumsum(e_bytes * (often | e_bwd))])  # window bytes of the entries before each
        # entry e is issued when entry m is taken, m the first with bytes(m+1 .. e) <= window
        m = np.searchsorted(cb, cb[1:] - window, side="left") - 1
        issue_at = np.where(m >= 0, compute_before[entries[np.maximum(m, 0)]], 0.0)
        backward_starts = float(rec_compute[~rec_is_bwd].sum())
        issue_at = np.where(e_bwd & ~often, np.maximum(issue_at, backward_starts), issue_at)
        slack = np.where(often | e_bwd, np.maximum(0.0, compute_before[entries] - issue_at), 0.0)
    read_one = io.read_s(P)
    e_read = io.read_s(e_bytes, reads_w[entries]) if len(entries) else np.zeros(0)
    # (the fetch overhead holds the upload's launch on a GPU machine, as the simulator charges it)
    e_stall = np.maximum(0.0, e_read - slack) + wl.fetch_overhead_s * reads_w[entries]
    param_stall = np.zeros(n)
    param_reads = np.zeros(n)
    param_slack = np.zeros(n)
    param_disk = np.zeros(n)
    owner = rec_shard[entries]
    np.add.at(param_stall, owner, k * e_stall)
    np.add.at(param_reads, owner, k * reads_w[entries])
    np.add.at(param_slack, owner, k * reads_w[entries] * slack)
    np.add.at(param_disk, owner, k * e_read)
    param_slack = np.divide(param_slack, param_reads, out=np.zeros(n), where=param_reads > 0)
    # the param file is rewritten after each update unless it is the master file
    rewrite = trainable & ~np.full(n, wl.param_file_is_master)
    write_window = wl.effective_write_window_bytes()
    param_disk += np.where(rewrite, uo * io.write_s(P), 0.0)
    if write_window == 0:
        param_stall += np.where(rewrite, uo * io.write_s(P), 0.0)
    # the store's CPU taken from the training thread (a CPU device): per byte the home moves
    param_moved = np.zeros(n)
    np.add.at(param_moved, owner, k * e_bytes)
    param_stall += wl.io_cpu_s_per_byte * (param_moved + np.where(rewrite, uo * P, 0.0))

    # -- optimizer group
    files = np.divide(O, numel * 4, out=np.zeros(n), where=numel > 0)  # master + moments files
    grad_w = np.minimum(wb, 1.0) * trainable  # expected gradients per pass (< 1: used in some passes only)
    readbacks = (k - 1) * grad_w  # sums read back before the next micro-batch adds to them
    eager = wl.updates_during_backward
    group_read = io.read_s(O, files) + (0 if eager else io.read_s(G))
    group_write = io.write_s(O, files)
    update = wl.update_overhead_s + numel * wl.update_s_per_elem
    if eager:
        # read asked for at the module's backward pre-hook; the main thread waits only when two
        # updates are queued: the slack is this module's backward and the next one's (the shard
        # before it in order)
        opt_slack = c_b + np.concatenate([[0.0], c_b[:-1]])
    elif wl.pipeline_read:
        opt_slack = np.concatenate([[0.0], update[:-1]])  # read while the group before is updated
    else:
        opt_slack = np.zeros(n)
    spills = k * grad_w if not eager else readbacks  # the last micro-batch's is updated at once when eager
    optim_stall = uo * np.maximum(0.0, group_read - opt_slack) + readbacks * io.read_s(G)
    if write_window == 0:
        optim_stall += uo * group_write + spills * io.write_s(G)
    optim_disk = uo * (group_read + group_write) + readbacks * io.read_s(G) + spills * io.write_s(G)
    optim_moved = uo * (2 * O + (0 if eager else G)) + (readbacks + spills) * G
    optim_stall += wl.io_cpu_s_per_byte * optim_moved
    # (a use in a fraction of the passes costs that fraction of its requests: expected values)
    optim_stall = np.where(trainable, optim_stall, 0.0)
    optim_disk = np.where(trainable, optim_disk, 0.0)

    from planner.workload import home_dram_bytes

    # each home alone in DRAM, the other on NVMe (tiers broadcast to every shard)
    param_bytes_dram = home_dram_bytes(wl, "cpu", "nvme").astype(np.float64)
    optim_bytes_dram = home_dram_bytes(wl, "nvme", "cpu").astype(np.float64)
    movable_o = trainable & df["pin_optim"].isna().to_numpy()
    out = pd.DataFrame({
        "shard": df["shard"],
        "param_reads_per_step": param_reads,
        "param_read_s": read_one,
        "param_slack_s": param_slack,
        "param_stall_s": param_stall,
        "param_disk_s": param_disk,
        "optim_stall_s": optim_stall,
        "optim_disk_s": optim_disk,
        "param_dram_bytes": param_bytes_dram.astype(np.int64),
        "optim_dram_bytes": optim_bytes_dram.astype(np.int64),
        "param_saved_s_per_byte": np.divide(param_stall, param_bytes_dram, out=np.zeros(n), where=param_bytes_dram > 0),
        "optim_saved_s_per_byte": np.divide(optim_stall, optim_bytes_dram, out=np.zeros(n), where=optim_bytes_dram > 0),
        "param_movable": movable_p,
        "optim_movable": movable_o,
    })
    return out


def _per_access_compute(wl: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of compute per pass of each shard's forward and backward uses: the pass's compute
    (step compute / micro-batches) spread over shards in proportion to ``compute_weight x uses``."""
    df = wl.shards
    k = max(1, int(wl.micro_batches))
    cw = df["compute_weight"].to_numpy(np.float64)
    wf = df["fwd_accesses_per_step"].to_numpy(np.float64)
    wb = df["bwd_accesses_per_step"].to_numpy(np.float64)
    f = cw * wf
    b = cw * wb
    c_f = f / f.sum() * (wl.compute_fwd_s / k) if f.sum() > 0 else np.zeros(len(df))
    c_b = b / b.sum() * (wl.compute_bwd_s / k) if b.sum() > 0 else np.zeros(len(df))
    return c_f, c_b
