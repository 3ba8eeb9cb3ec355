"""Predict the step time of any placement: a small event simulation of what the engine does.

The simulator replays one optimizer step of a :class:`~planner.workload.Workload` under a
placement, on two clocks - the main (training) thread and the disk - and returns a
:class:`Prediction`. It follows the engine (``zinf/engine.py``, ``zinf/prefetch.py``) step by step:

**Passes.** A step is ``micro_batches`` passes (forward then backward). The forward visits the
shards in ``order``, the backward in reverse order; each use of a shard computes for ``compute
share x uses`` seconds, its share of the measured compute being proportional to ``compute_weight``
(numel by default). A shard's uses in one phase are one visit (repeated uses read once: the engine
keeps a param needed again soon, and holds chunks for the pass). Fractional uses (an expert routed
to in 30% of passes) count as that fraction of its bytes, requests and compute (an expected-value
model: it is read, computed and updated "0.3 times").

**Params.** A param at home on the compute device (on a CPU machine: any DRAM home) is resident and
costs nothing; a DRAM home on a GPU machine is copied at ``copy_Bps`` (a stall). An NVMe param is
read, and the reads follow the prefetcher exactly: the trace of a pass is the NVMe reads in visit
order (a chunk once per pass; a one-parameter shard in forward and again in backward); every
fetch takes its shard's read from the reads in flight (or reads it on the spot: a miss), moves
along the trace, drops reads the pass went past, and issues the next reads in trace order while
``reads in flight + kept params <= prefetch_bytes``; the next pass starts with an empty window. A
released param whose next use is within ``reuse_distance_bytes`` of trace is *kept* when the
window has room (and its next read is then skipped). Like ``zinf/prefetch.py``, the issuer skips
a shard that is in use (its next read is issued after it is freed); ``reissue_in_use=True`` models
the prefetcher before session 30, which issued it, so that a shard's backward read could be issued
while its forward ran and then be wasted when the shard was kept (``Prediction.wasted_read_bytes``).
Like ``zinf/prefetch.py``, the prefetcher reads ahead along the trace only shards the forward
uses in at least ``MIN_USE_RATE`` of the passes: a forward use of one used less often (an expert
routed to in 30% of them) is a miss, and its backward read is issued only once backward starts
(the engine then follows what this pass's forward used). A window smaller than the largest NVMe
param is 0, as the engine sizes it.

**Disk.** Every NVMe read and write - prefetches, misses, optimizer groups, gradients, param
rewrites - costs the cost model's ``latency + bytes x (1 / bandwidth + others x shared)`` per
request, where ``others`` is the number of the queue's requests still in flight when it starts
(the disk's sharing, fitted from each sample's concurrency; :mod:`planner.costmodel`). Asynchronous requests
(``read_async``/``write_async``: prefetches, misses, optimizer groups, writes behind) wait in one
FIFO queue served by ``disk_servers`` servers, but for a miss (a param read the training thread
waits for), which goes ahead of the requests not started yet and starts when a server finishes the
one it runs, as the store's urgent reads do (the requests it overtakes keep the landings worked out
for them; the queue's tail waits as long as the miss); synchronous ones (``store.write`` on the
calling thread: any write when there is no write window) start at once beside them, as in the
store. The default is the engine's number of request threads (``max(2, aio.thread_count)``: the
NVMe store runs that many requests at once). A synchronous request sees the queue's requests in
flight as ``others`` too, so a placement that writes synchronously while nothing else is in
flight gets the disk alone (the cost model's profiles without concurrency give ``shared`` = 0 and a per-request bandwidth under the run's own
concurrency: then every request costs the same, as before). Writes go through a window of ``write_window_bytes`` in flight (waiting for room blocks the writing thread);
0 makes them synchronous.

**Gradients and the optimizer.** A gradient whose optimizer home is NVMe is written to its file
after each micro-batch (asynchronously) and read back before the next one adds to it: the read
is queued at the module's backward pre-hook, beside its compute, and the gradient waits for it.
With ``updates_during_backward`` (``zinf.overlap_optimizer`` and no clipping) the last pass
updates NVMe groups on a worker thread while backward goes on: the group read is asked for at the
module's backward, the update queued when its gradient is final (the main thread waits when two
are queued), its write-back issued from the worker; chunks are queued when backward ends. With
``dram_updates_during_backward`` (CUDA) the shards whose optimizer home is in DRAM are queued on
the same worker when their gradient is final, with nothing to read and no cap (the main thread
waits for them only at the optimizer phase). On a CPU
device the worker's compute takes cores from the training thread: ``cpu_contention`` (1 there,
0 with a GPU) is the fraction of each such update charged to the main thread too. The
optimizer phase then waits for the worker and updates the rest in order on the main thread; for
NVMe groups (when not updated during backward) the read of the next group is in flight while the
current one is updated (``pipeline_read``) and write-backs run behind. An update takes
``update_overhead_s + numel x update_s_per_elem``; a trainable shard whose param is on NVMe in its
own file also rewrites it after the update. DRAM homes cost no I/O.

**The store's CPU.** On a CPU device the store's request threads run on the cores torch
computes on, and the training thread loses ``io_cpu_s_per_byte`` of compute per NVMe byte moved
(``measure_io_cpu``: 0.45-0.51 ms per MB on the 2-core VM). The measured compute already ran
beside the measured steps' NVMe bytes (``io_cpu_base_bytes``), so ``io_cpu_s`` is the cost of the
bytes beyond them (negative for fewer), added to the main thread's time as a whole (an expected
value: it does not say which phase it slows).

**Steady state and the step time.** The step is simulated twice when I/O is left over at its end:
the second time the disk starts with the first run's backlog (write-backs of the previous step
delay the next step's first reads). ``step_s = max(main thread + io_cpu_s, disk busy / servers) + overhead_s``: a
step cannot in the long run be shorter than the disk time it needs (``io_bound_s`` is the excess), and
``overhead_s`` is the workload's calibrated residual (:func:`calibrate`): the measured step minus
the simulation of the measured placement, so that the prediction of the placement the run is in
matches what was measured. It is one explicit number per workload, the same for every placement.

Not modelled: CPU contention other than ``cpu_contention`` and ``io_cpu_s``, page-cache effects, module
nesting (a parent's params held while children run), the real module trace (order is shard order),
the prefetcher's ``2 x window`` look-ahead limit, and reads of the gradient by clipping.

Units: seconds (``_s``), bytes (``_bytes``), bytes per second (``_Bps``).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np
import pandas as pd

from zinf.prefetch import MIN_USE_RATE

from planner.hotness import _per_access_compute, io_costs
from planner.workload import Workload, normalize_placement

__all__ = ["Prediction", "simulate", "calibrate", "Simulator"]

# tier codes used inside the simulation
P_RESIDENT, P_COPY, P_NVME = 0, 1, 2
O_NONE, O_DRAM, O_NVME = 0, 1, 2
# how a backward visit's shard is updated during backward (0: in the optimizer phase)
EAGER_NVME, EAGER_DRAM = 1, 2


@dataclass
class Prediction:
    """The simulated step of one placement (seconds per optimizer step; bytes per step)."""

    step_s: float
    """``max(main thread + io_cpu_s, disk busy / servers) + overhead_s``."""
    forward_s: float
    """Forward passes, stalls included."""
    backward_s: float
    """Backward passes, stalls included."""
    optimizer_s: float
    """The optimizer phase (waiting for updates queued during backward, then the rest)."""
    stall_s: float
    """Main-thread time in forward and backward waiting for params, gradients read back, room for
    gradient writes (the whole write without a window), queued updates (as the engine's ``stall_s``
    counts it)."""
    io_bound_s: float
    """The disk's time (``disk_busy_s / disk_servers``) beyond the main thread's: the disk is the
    bottleneck."""
    overhead_s: float
    """The workload's calibrated residual, added as is."""
    compute_s: float
    """Forward + backward compute and the updates (no I/O)."""
    disk_busy_s: float
    """Seconds of disk service the step needs (summed over requests)."""
    disk_servers: int
    """Requests the simulated disk served at once."""
    nvme_read_bytes: float
    """Bytes read from NVMe, wasted prefetches included."""
    nvme_write_bytes: float
    """Bytes written to NVMe."""
    wasted_read_bytes: float = 0.0
    """Prefetched bytes dropped unused (see the module docstring)."""
    io_cpu_s: float = 0.0
    """Compute the training thread loses to the store's threads: (NVMe bytes - the workload's
    ``io_cpu_base_bytes``, which the measured compute already holds) x ``io_cpu_s_per_byte`` (a
    CPU device), added to the main thread's time; negative for a placement moving fewer bytes."""
    per_shard_stall_s: pd.Series | None = None
    """Stall per step caused by each shard (param fetches, gradient read-backs and writes), when asked."""

    @property
    def roofline_s(self) -> float:
        """The step can be no faster than its compute, nor than its disk time."""
        return max(self.compute_s, self.disk_busy_s / self.disk_servers)

    @property
    def raw_step_s(self) -> float:
        """The simulated step without the calibrated overhead."""
        return self.step_s - self.overhead_s

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if k != "per_shard_stall_s"}


# what the prefetcher does when the pass reaches a trace entry, besides taking a read in flight
MISS, KEPT = -1, -2

URGENT_LOOKBACK = 32
"""How many of the disk queue's latest requests a miss looks through for those in flight."""


class _Trace:
    """One placement as the runs of :meth:`Simulator.run` replay it (built once per run, mostly
    with numpy): what each record of a pass does, the NVMe trace, what the prefetcher does along
    it, and the optimizer phase's updates."""

    pc: list[int] | None
    """Param tier codes (with updates during backward only: NVMe groups', or DRAM homes' on CUDA)."""
    window: int
    """The prefetch window (bytes; 0 when the largest NVMe param does not fit)."""
    write_window: int
    """Bytes of writes that may be in flight (0: writes are synchronous)."""
    entries: int
    e_bytes: list[float]
    """Per entry of the trace: its read's bytes, and its requests (``e_w``, expected: < 1 for a
    shard used in some passes only) when the disk is shared, else its seconds (``e_read_s``)."""
    e_w: list[float]
    e_read_s: list[float]
    issue_order: list[int]
    begin: int
    at_backward: int
    issued: list[int]
    took: list[int]
    dropped: list[float]
    """The prefetcher's actions (:meth:`Simulator._prefetch`)."""
    forward: tuple[list, ...]
    """Columns of the forward records: shard, entry (-1: none), compute, read weight, fixed wait,
    gradient bytes to NVMe (-1: none), how it is updated during backward (0, EAGER_NVME, EAGER_DRAM),
    the reads the model announces at this record (``(entry, weight)`` pairs; see
    :attr:`planner.workload.Workload.announced_reads`; the backward records' are empty)."""
    backward: tuple[list, ...]
    eager_chunks: list[int]
    """NVMe chunk groups updated when backward ends (eager)."""
    dram_eager_chunks: list[int]
    """Chunks with a DRAM optimizer home updated when backward ends (CUDA)."""
    todo: tuple[list, ...]
    """Columns of the optimizer phase's updates: shard, NVMe group, param file rewritten."""
    todo_nvme: list[int]


class Simulator:
    """A workload, a cost model and the engine settings, ready to simulate many placements.

    The per-shard arrays are prepared once; :meth:`run` takes tier codes (what the solver uses),
    :meth:`predict` a placement mapping. A run first works out what does not depend on time - the
    placement's trace, what each record of a pass does, and what the prefetcher does along the
    trace (its decisions depend on bytes only: every pass of both runs makes the same ones) - and
    then replays the clocks on it (~0.1 s for 10^5 shards, then ~0.15 s a run on the dev VM).
    """

    def __init__(self, workload: Workload, cost_model, *, prefetch_bytes: int | None = None,
                 reuse_distance_bytes: int | None = None, disk_servers: int | None = None, reissue_in_use: bool = False,
                 write_window_bytes: int | None = None):
        wl = workload
        self.workload = wl
        self.io = io_costs(cost_model)
        df = wl.shards
        self.names = df["shard"].tolist()
        self.n = n = len(df)
        self.k = max(1, int(wl.micro_batches))
        self.prefetch_bytes = int(wl.prefetch_bytes if prefetch_bytes is None else prefetch_bytes)
        self.reuse_distance_bytes = int(wl.reuse_distance_bytes if reuse_distance_bytes is None else reuse_distance_bytes)
        self.disk_servers = max(1, int(wl.disk_servers if disk_servers is None else disk_servers))
        self.reissue_in_use = bool(reissue_in_use)
        self.write_window_override = write_window_bytes
        P = df["param_bytes"].to_numpy(np.float64)
        O = df["optim_bytes"].to_numpy(np.float64)
        G = df["grad_bytes"].to_numpy(np.float64)
        numel = df["numel"].to_numpy(np.float64)
        k = self.k
        wf = df["fwd_accesses_per_step"].to_numpy(np.float64) / k
        wb = df["bwd_accesses_per_step"].to_numpy(np.float64) / k
        chunk = df["chunk"].to_numpy(bool)
        trainable = df["trainable"].to_numpy(bool)
        uo = np.clip(df["opt_accesses_per_step"].to_numpy(np.float64), 0.0, 1.0) * trainable
        c_f, c_b = _per_access_compute(wl)
        files = np.divide(O, numel * 4, out=np.ones(n), where=numel > 0)  # master + moments
        update_s = wl.update_overhead_s + numel * wl.update_s_per_elem
        self.group_bytes = O + G  # for the engine's write window
        self.compute_s = float(wl.compute_fwd_s + wl.compute_bwd_s + (uo * update_s).sum())
        self.copy_s_per_byte = 0.0 if not math.isfinite(wl.copy_Bps) or wl.copy_Bps <= 0 else 1.0 / wl.copy_Bps
        # per shard, as arrays for the traces
        self._P, self._G, self._chunk, self._trainable, self._uo = P, G, chunk, trainable, uo
        # and as lists for the replays: an update's seconds (``uo`` x: a shard updated in a
        # fraction of the steps does that fraction of its update and I/O, expected values), and
        # its I/O as lists of bytes and of requests: the group read at the optimizer phase
        # (master, moments, spilled gradient), the master and moments (read during backward,
        # written back), the param file's rewrite
        self.update_seconds = (uo * update_s).tolist()
        self.worker_s = (float(wl.cpu_contention) * uo * update_s).tolist()  # its compute charged to the main thread
        self.group_read = (uo * (O + G)).tolist(), (uo * (files + 1)).tolist()
        self.group_io = (uo * O).tolist(), (uo * files).tolist()
        self.param_io = (uo * P).tolist(), uo.tolist()
        # the records of a pass: the forward visits in order, the backward ones in reverse order
        # (their shard, compute seconds and read weight: expected reads per pass, < 1 when the
        # shard is used in some passes only)
        self.fwd_order, self.bwd_order = np.flatnonzero(wf > 0), np.flatnonzero(wb > 0)[::-1]
        self.f_w, self.b_w = np.minimum(wf, 1.0)[self.fwd_order], np.minimum(wb, 1.0)[self.bwd_order]
        self._fwd_rate = np.minimum(wf, 1.0)  # per shard: the share of passes whose forward uses it
        nf = len(self.fwd_order)  # (a forward visit sends no gradient, and asks for no group read)
        self._forward = (self.fwd_order.tolist(), c_f[self.fwd_order].tolist(), self.f_w.tolist(), [-1.0] * nf, [False] * nf)
        self._backward = (self.bwd_order.tolist(), c_b[self.bwd_order].tolist(), self.b_w.tolist())
        # runs of forward records whose shards the forward seldom uses (the routed experts of one
        # layer, in a row in the trace): [start, end) each, where the model announces them at once
        self._seldom_runs: list[tuple[int, int]] = []
        if wl.announced_reads:
            seldom = np.concatenate([[False], self._fwd_rate[self.fwd_order] < MIN_USE_RATE, [False]])
            edges = np.flatnonzero(seldom[1:] != seldom[:-1])  # starts and ends, alternating
            self._seldom_runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))

    # ---------------------------------------------------------------- placement -> codes
    def codes(self, placement) -> tuple[list[int], list[int]]:
        """Tier codes (param, optim) per shard of a placement mapping."""
        wl = self.workload
        p = normalize_placement(wl, placement)
        cpu_device = wl.device == "cpu"
        pc, oc = [], []
        for name in self.names:
            t = p[name]
            pt, ot = t["param"], t["optim"]
            pc.append(P_NVME if pt == "nvme" else P_RESIDENT if (pt == "gpu" or cpu_device) else P_COPY)
            oc.append(O_NVME if ot == "nvme" else O_NONE if ot in ("none", None) else O_DRAM)
        return pc, oc

    def predict(self, placement, *, per_shard: bool = False) -> Prediction:
        pc, oc = self.codes(placement)
        return self.run(pc, oc, per_shard=per_shard)

    # ---------------------------------------------------------------- the simulation
    def run(self, pc, oc, *, per_shard: bool = False) -> Prediction:
        """Simulate one steady-state step for tier codes ``pc`` (param) and ``oc`` (optim), lists
        or arrays."""
        trace = self._trace(pc, oc)  # once for both runs
        first = self._step(trace, None, per_shard)
        if first["backlog"] is not None:
            out = self._step(trace, first["backlog"], per_shard)
        else:
            out = first
        wl = self.workload
        # the store's threads computing on the training thread's cores (a CPU device), beyond what
        # the measured compute already ran beside (negative: a placement moving fewer bytes)
        io_cpu = (out["read_bytes"] + out["write_bytes"] - wl.io_cpu_base_bytes) * wl.io_cpu_s_per_byte
        main_s = out["forward_s"] + out["backward_s"] + out["optimizer_s"] + io_cpu
        disk_s = out["disk_busy_s"] / self.disk_servers  # the disk's own time: its servers work at once
        io_bound = max(0.0, disk_s - main_s)
        stall = None
        if per_shard:
            stall = pd.Series(out["per_shard"], index=self.names, name="stall_s")
        return Prediction(
            step_s=main_s + io_bound + wl.overhead_s,
            forward_s=out["forward_s"], backward_s=out["backward_s"], optimizer_s=out["optimizer_s"],
            stall_s=out["stall_s"], io_bound_s=io_bound, overhead_s=wl.overhead_s, compute_s=self.compute_s,
            disk_busy_s=out["disk_busy_s"], disk_servers=self.disk_servers, nvme_read_bytes=out["read_bytes"], nvme_write_bytes=out["write_bytes"],
            wasted_read_bytes=out["wasted_bytes"], per_shard_stall_s=stall, io_cpu_s=io_cpu,
        )

    def _write_window(self, oc: np.ndarray) -> int:
        if self.write_window_override is not None:
            return int(self.write_window_override)
        wl = self.workload
        if wl.write_window_bytes is not None:
            return int(wl.write_window_bytes)
        nv = self.group_bytes[oc == O_NVME]
        return int(2 * nv.max()) if nv.size else 0

    def _trace(self, pc, oc) -> _Trace:
        """A placement's :class:`_Trace`."""
        tr = _Trace()
        pc, oc = np.asarray(pc), np.asarray(oc)
        eager = self.workload.updates_during_backward
        dram_eager = self.workload.dram_updates_during_backward
        tr.pc = pc.tolist() if eager or dram_eager else None  # (for the updates run during backward)
        P, chunk, uo = self._P, self._chunk, self._uo
        fwd, bwd, f_w, b_w = self.fwd_order, self.bwd_order, self.f_w, self.b_w
        p_nvme, o_nvme, o_dram = pc == P_NVME, oc == O_NVME, oc == O_DRAM
        io = self.io
        # prefetch window: 0 when the largest NVMe param would not fit (as the engine sizes it)
        tr.window = self.prefetch_bytes
        if p_nvme.any() and tr.window < P[p_nvme].max():
            tr.window = 0
        tr.write_window = self._write_window(oc)
        # the trace: forward visits of NVMe params, backward visits of NVMe one-parameter shards
        # (a chunk is held for the whole pass)
        f_in, b_in = p_nvme[fwd], p_nvme[bwd] & ~chunk[bwd]
        nf = int(f_in.sum())
        E = nf + int(b_in.sum())
        e_shard = np.concatenate([fwd[f_in], bwd[b_in]])
        e_w = np.concatenate([f_w[f_in], b_w[b_in]])
        e_bytes = P[e_shard] * e_w
        tr.entries, tr.e_bytes = E, e_bytes.tolist()
        # the entries of shards the forward uses in at least MIN_USE_RATE of the passes: read ahead
        # from the pass's start; the others' forward entries are read when needed, their backward
        # ones once backward starts
        ahead = self._fwd_rate[e_shard] >= MIN_USE_RATE
        # a read's seconds: known now when the cost model has no sharing, else worked out from
        # its requests and the requests in flight as it starts
        if io.read_shared_s_per_byte == 0.0 and io.write_shared_s_per_byte == 0.0:
            tr.e_read_s = (e_w * io.read_latency_s + e_bytes * io.read_alone_s_per_byte).tolist()
        else:
            tr.e_w = e_w.tolist()
        f_entry, b_entry = np.full(len(fwd), -1), np.full(len(bwd), -1)
        f_entry[f_in], b_entry[b_in] = np.arange(nf), np.arange(nf, E)
        # keep for reuse: a forward entry's backward entry when it is within the reuse distance of
        # trace from the entry after it (-1: never kept)
        keep = np.full(E, -1)
        if tr.window > 0 and self.reuse_distance_bytes > 0 and nf:
            cum = np.concatenate([[0.0], np.cumsum(e_bytes)])  # sequential sums, as a loop adds them
            bwd_entry_of = np.full(self.n, -1)
            bwd_entry_of[bwd[b_in]] = np.arange(nf, E)
            e2 = np.where(chunk[e_shard[:nf]], -1, bwd_entry_of[e_shard[:nf]])
            near = cum[np.maximum(e2, 0)] - cum[1:nf + 1] <= self.reuse_distance_bytes
            keep[:nf] = np.where((e2 >= 0) & near, e2, -1)
        self._prefetch(tr, e_shard.tolist(), keep.tolist(), ahead.tolist(), nf)
        # what a materialisation waits besides its read: an NVMe param the fetch overhead (as
        # recorded: resizing, copying out of the read buffer, launching the upload), a DRAM
        # param on a GPU machine its upload (bytes / copy_Bps, fitted on those fetches' whole
        # time), but a chunk's backward visit
        fetch_over, copy_spb = self.workload.fetch_overhead_s, self.copy_s_per_byte
        f_copy, b_copy = pc[fwd] == P_COPY, (pc[bwd] == P_COPY) & ~chunk[bwd]
        f_fixed = f_w * np.where(f_in, fetch_over, np.where(f_copy, P[fwd] * copy_spb, 0.0))
        b_fixed = b_w * np.where(b_in, fetch_over, np.where(b_copy, P[bwd] * copy_spb, 0.0))
        # a backward visit's gradient to an NVMe group: its bytes (-1: none), and how the shard is
        # updated during backward: EAGER_NVME (when eager: its group read asked for at the
        # pre-hook, the update queued when the gradient is final), EAGER_DRAM (a DRAM optimizer
        # home with CUDA: queued when final, nothing to read) or 0 (in the optimizer phase)
        b_grad = np.where(self._trainable[bwd] & o_nvme[bwd], self._G[bwd] * b_w, -1.0)
        one_param = ~chunk[bwd] & (uo[bwd] > 0)
        b_eager = np.where(o_nvme[bwd] & one_param, EAGER_NVME, np.where(o_dram[bwd] & one_param & dram_eager, EAGER_DRAM, 0))
        fs, fc, fw, no_grad, no_eager = self._forward
        bs, bc, bw = self._backward
        f_entries = f_entry.tolist()
        tr.forward = (fs, f_entries, fc, fw, f_fixed.tolist(), no_grad, no_eager, self._announced(tr, f_entries, fw))
        tr.backward = (bs, b_entry.tolist(), bc, bw, b_fixed.tolist(), b_grad.tolist(), b_eager.tolist(), [()] * len(bs))
        tr.eager_chunks = np.flatnonzero(chunk & o_nvme & (uo > 0)).tolist()
        tr.dram_eager_chunks = np.flatnonzero(chunk & o_dram & (uo > 0)).tolist() if dram_eager else []
        # the optimizer phase: the updates not run during backward, in shard order; an NVMe group
        # writes its master and moments back, an NVMe param file is rewritten (unless it is the
        # master file of an NVMe group)
        master_file = self.workload.param_file_is_master
        todo = np.flatnonzero((uo > 0) & (oc != O_NONE) & ~(o_nvme & eager) & ~(o_dram & dram_eager))
        group = o_nvme[todo]
        tr.todo = (todo.tolist(), group.tolist(), (p_nvme[todo] & ~(group & master_file)).tolist())
        tr.todo_nvme = todo[group].tolist()
        return tr

    def _announced(self, tr: _Trace, f_entries: list[int], fw: list[float]) -> list[tuple]:
        """Per forward record, the reads the model starts there by announcing what it runs next
        (``zinf.will_use``; the MoE layer names its routed experts): at the first record of each
        run of seldom-used records (``_seldom_runs``), the NVMe reads of that run the prefetcher
        would miss, all queued at once. The window's room is not modelled for them."""
        out: list[tuple] = [()] * len(f_entries)
        if tr.window <= 0:
            return out
        took = tr.took
        for start, end in self._seldom_runs:
            out[start] = tuple((e, fw[j]) for j in range(start, end) if (e := f_entries[j]) >= 0 and took[e] == MISS)
        return out

    def _prefetch(self, tr: _Trace, e_shard: list[int], keep: list[int], ahead: list[bool], nf: int) -> None:
        """What the prefetcher does along a pass's trace: ``tr.issue_order`` (the entries whose
        reads it issues, in order: ``tr.begin`` of them as the pass begins, then per entry
        ``tr.issued[e]`` once entry e is taken, and ``tr.at_backward`` when backward starts, after
        the ``nf`` forward entries; counts, not lists: no object per entry for the garbage
        collector to track), per entry ``tr.took`` (the entry whose read it takes, or MISS /
        KEPT), and ``tr.dropped`` (bytes of the reads dropped unread, in order). This depends on
        the trace's bytes only, never on time, so every pass of both runs does the same: it is
        worked out once.

        As ``zinf/prefetch.py`` does: taking an entry frees its read's room in the window, drops
        the reads the pass went past, and issues the next reads in trace order while they fit
        (reads in flight + kept params <= window); a shard whose earlier read is still in flight
        (or, ``reissue_in_use=False``, that is in use) is deferred and retried later; a forward
        entry's param is kept for its backward entry (``keep``) when the window has room. An
        entry of a shard the forward seldom uses (``ahead`` False) is passed over among the
        forward entries, and deferred among the backward ones until backward starts."""
        E, W = tr.entries, tr.window
        tr.issue_order, tr.begin, tr.at_backward, tr.issued, tr.took, tr.dropped = [], 0, 0, [0] * E, [MISS] * E, []
        if W <= 0:  # no prefetch: every read is a miss, nothing is kept
            return
        e_bytes, out, took, dropped = tr.e_bytes, tr.issue_order, tr.took, tr.dropped
        block_in_use = not self.reissue_in_use
        # per shard: the entry of its read in flight, the entry it is kept for (-1: none)
        flying, kept = [-1] * self.n, [-1] * self.n
        deferred: list[int] = []  # entries skipped because their shard was busy, or backward's not begun
        used = 0.0  # window bytes: in flight + kept
        scan = 0  # first entry not yet looked at by the issuer

        def issue(e: int, s: int, backward: bool) -> None:
            """Issue reads after entry ``e`` (-1: none yet) with shard ``s`` in use (-1: none):
            first the deferred entries the pass has not gone past, then along the trace, while
            the reads fit; an entry whose shard is kept is covered, one whose shard is busy (or
            seldom used, before ``backward``) is deferred."""
            nonlocal used, scan
            if deferred:
                rest = []
                for j, x in enumerate(deferred):
                    if x <= e or kept[e_shard[x]] >= 0:
                        continue
                    if flying[e_shard[x]] >= 0 or (block_in_use and e_shard[x] == s) or not (ahead[x] or backward):
                        rest.append(x)
                    elif used + e_bytes[x] > W:
                        deferred[:] = rest + deferred[j:]
                        return
                    else:
                        flying[e_shard[x]] = x
                        used += e_bytes[x]
                        out.append(x)
                deferred[:] = rest
            if scan <= e:
                scan = e + 1
            while scan < E:
                x = e_shard[scan]
                if kept[x] < 0 and (scan >= nf or ahead[scan]):  # (a seldom used forward entry: a miss)
                    if flying[x] >= 0 or (block_in_use and x == s) or not (ahead[scan] or backward):
                        deferred.append(scan)
                    elif used + e_bytes[scan] > W:
                        return
                    else:
                        flying[x] = scan
                        used += e_bytes[scan]
                        out.append(scan)
                scan += 1

        issue(-1, -1, nf == 0)  # begin_pass
        tr.begin = len(out)
        for e in range(E):
            # take entry e: its read's room (or its kept param's) is free again
            s = e_shard[e]
            x = kept[s]
            if x >= 0:  # kept since its forward: no read
                used -= e_bytes[x]
                kept[s] = -1
                took[e] = KEPT
            else:
                x = flying[s]
                if x >= 0:
                    used -= e_bytes[x]
                    took[e] = x
                    flying[s] = -1
            # drop the reads the pass went past: entries are taken in order and reads issued
            # only after the entry taken, so only the previous entry's can be left (if kept)
            if e and flying[e_shard[e - 1]] == e - 1:
                flying[e_shard[e - 1]] = -1
                used -= e_bytes[e - 1]
                dropped.append(e_bytes[e - 1])
            before = len(out)
            issue(e, s, e >= nf)
            tr.issued[e] = len(out) - before
            # release: keep it for its backward entry when the window has room
            x = keep[e]
            if x >= 0 and used + e_bytes[x] <= W:
                kept[s] = x
                used += e_bytes[x]
            if e == nf - 1:  # begin_backward: the last forward shard is released; issue again
                before = len(out)
                issue(e, -1, True)
                tr.at_backward = len(out) - before
        if E and flying[e_shard[E - 1]] == E - 1:  # left in flight when the pass ends
            dropped.append(e_bytes[E - 1])

    def _step(self, tr: _Trace, backlog, per_shard):  # noqa: C901 - one loop, commented inline
        io = self.io
        r_lat, w_lat = io.read_latency_s, io.write_latency_s
        # seconds per byte alone on the disk, and added per other request in flight
        r_spb, w_spb = io.read_alone_s_per_byte, io.write_alone_s_per_byte
        r_share, w_share = io.read_shared_s_per_byte, io.write_shared_s_per_byte
        shared = r_share != 0.0 or w_share != 0.0  # else a request costs the same whatever is in flight
        wl = self.workload
        k = self.k
        pc = tr.pc
        update_seconds, worker_s = self.update_seconds, self.worker_s
        (gr_bytes, gr_reqs), (g_bytes, g_reqs), (p_bytes, p_reqs) = self.group_read, self.group_io, self.param_io
        eager = wl.updates_during_backward
        master_file = wl.param_file_is_master
        stall_of = [0.0] * self.n if per_shard else None
        cap = tr.write_window
        e_bytes = tr.e_bytes
        e_w, e_read_s = (tr.e_w, None) if shared else (None, tr.e_read_s)

        # -- the disk: one FIFO queue, `servers` requests at once (a heap of their free times)
        servers = self.disk_servers
        busy = rbytes = wbytes = wasted = 0.0
        if backlog is None:
            free = [0.0] * servers
            wq: list = []  # writes in flight: heap of (done time, bytes)
        else:
            free = list(backlog["free"])
            wq = list(backlog["writes"])
        heapq.heapify(free)
        heapq.heapify(wq)
        wq_bytes = sum(b for _, b in wq)
        heapreplace, heappush, heappop = heapq.heapreplace, heapq.heappush, heapq.heappop

        # others(start): requests of the queue still in flight at ``start`` (they share the disk
        # with a new one). Asked only when the cost model has sharing (``shared``): else every
        # request costs the same whatever is in flight. Two servers (the default): two compares.
        if servers == 2:
            def others(start: float) -> int:
                return (free[0] > start) + (free[1] > start)
        else:
            def others(start: float) -> int:
                return sum(1 for f in free if f > start)

        # the queue's latest requests, (start, end) in the order queued: what is in flight when a
        # miss jumps the queue (read_urgent)
        starts: list[float] = []
        ends: list[float] = []

        def read(t: float, nbytes: float, requests: float = 1.0) -> float:
            """Queue a read at time t; returns when it lands."""
            nonlocal busy, rbytes
            f = free[0]
            start = t if t > f else f
            dur = requests * r_lat + nbytes * ((r_spb + others(start) * r_share) if shared else r_spb)
            busy += dur
            rbytes += nbytes
            end = start + dur
            heapreplace(free, end)
            starts.append(start)
            ends.append(end)
            return end

        def read_urgent(t: float, nbytes: float, requests: float = 1.0) -> float:
            """A read the training thread waits for (a miss): as the store's request threads, it
            goes ahead of the requests queued and not started at t, and starts as soon as a
            server is free of the request it runs (among the queue's latest). The requests it
            overtook are not moved (their landings are worked out already): the queue's tail is."""
            nonlocal busy, rbytes
            f = free[0]
            if f <= t:  # a server is free: nothing queued to overtake
                start = t
            else:
                running, first_end = 0, math.inf
                # (queued in about the order they start: those started by t end at i, and those
                # running are among the last few of them)
                lo = max(0, len(starts) - URGENT_LOOKBACK)
                i = bisect_right(starts, t, lo)
                for j in range(i - 1, max(lo, i - 2 * servers - 2) - 1, -1):
                    if t < ends[j]:
                        running += 1
                        if ends[j] < first_end:
                            first_end = ends[j]
                start = t if running < servers else first_end
            dur = requests * r_lat + nbytes * ((r_spb + others(start) * r_share) if shared else r_spb)
            busy += dur
            rbytes += nbytes
            end = start + dur
            heapreplace(free, (f if f > start else start) + dur)  # the queue behind it waits as long
            starts.append(start)
            ends.append(end)
            return end

        def write(t: float, nbytes: float, requests: float = 1.0) -> float:
            """Write from a thread at time t; returns when that thread may go on."""
            nonlocal busy, wbytes, wq_bytes
            if nbytes <= 0:
                return t
            wbytes += nbytes
            if cap <= 0:  # synchronous: store.write on the calling thread, not queued
                dur = requests * w_lat + nbytes * ((w_spb + others(t) * w_share) if shared else w_spb)
                busy += dur
                return t + dur
            while wq and wq[0][0] <= t:
                wq_bytes -= heappop(wq)[1]
            while wq and wq_bytes + nbytes > cap:  # reserve: wait for room (one write alone always goes)
                d, b = heappop(wq)
                wq_bytes -= b
                if d > t:
                    t = d
            f = free[0]
            start = t if t > f else f
            dur = requests * w_lat + nbytes * ((w_spb + others(start) * w_share) if shared else w_spb)
            busy += dur
            end = start + dur
            heapreplace(free, end)
            starts.append(start)
            ends.append(end)
            heappush(wq, (end, nbytes))
            wq_bytes += nbytes
            return t

        landing = [0.0] * tr.entries  # of each trace entry's read issued in this pass

        def prefetch(t: float, first: int, count: int) -> None:
            """The prefetcher issues ``count`` reads of ``tr.issue_order`` from ``first`` at time
            t (``read``, inline)."""
            nonlocal busy, rbytes
            for x in order[first:first + count]:
                f = free[0]
                start = t if t > f else f
                dur = (e_w[x] * r_lat + e_bytes[x] * (r_spb + others(start) * r_share)) if shared else e_read_s[x]
                busy += dur
                rbytes += e_bytes[x]
                landing[x] = end = start + dur
                heapreplace(free, end)
                starts.append(start)
                ends.append(end)

        t = 0.0
        stall = 0.0
        fwd_s = bwd_s = 0.0
        # updates during backward: a worker thread and the main thread's queue of two
        worker_free = 0.0
        queued: list[float] = []  # completion times of updates submitted, oldest first
        dram_done = 0.0  # when the last DRAM-home update submitted during backward ends
        group_done: dict[int, float] = {}  # NVMe group reads in flight -> landing time

        def submit_update(t: float, i: int) -> float:
            nonlocal worker_free, stall
            while len(queued) >= 2:  # the engine waits for the oldest when two are queued
                d = queued.pop(0)
                if d > t:
                    stall += d - t
                    t = d
            start = max(worker_free, t, group_done.pop(i, t))
            end = start + update_seconds[i]
            t += worker_s[i]  # the worker's compute takes cores from the main thread
            tw = write(end, g_bytes[i], g_reqs[i])
            if pc[i] == P_NVME and not master_file:
                tw = write(tw, p_bytes[i], p_reqs[i])
            worker_free = tw
            queued.append(tw)
            return t

        def submit_dram_update(t: float, i: int) -> float:
            """A DRAM optimizer home's update on the worker (CUDA): nothing read, the main
            thread never waits for it until the optimizer phase; an NVMe param file is rewritten."""
            nonlocal worker_free, dram_done
            end = max(worker_free, t) + update_seconds[i]
            t += worker_s[i]
            if pc[i] == P_NVME:
                end = write(end, p_bytes[i], p_reqs[i])
            worker_free = dram_done = end
            return t

        # -- the passes: first / middle / middle (x k-3) / last
        # (a middle pass is simulated once as is, then once more for the other k - 3: the second
        # starts with the disk backlog a middle pass leaves, the steady state of the passes between)
        kinds = [("last", 1)] if k == 1 else [("first", 1)] + [("middle", 1)] * min(1, k - 2) + \
            [("middle", k - 3)] * (k > 3) + [("last", 1)]
        order, issued, took = tr.issue_order, tr.issued, tr.took
        for kind, repeat in kinds:
            t_pass = t
            busy0, rb0, wb0, ws0, st0 = busy, rbytes, wbytes, wasted, stall
            last = kind == "last"
            readback = kind != "first" and k > 1  # a gradient's sum so far comes back from its file
            prefetch(t, 0, tr.begin)  # begin_pass
            announced_landing: dict[int, float] = {}  # entry -> when its announced read lands
            n_issued = tr.begin  # reads issued so far in the pass
            for is_bwd, records in ((False, tr.forward), (True, tr.backward)):
                if is_bwd:
                    t_bwd_start = t
                    prefetch(t, n_issued, tr.at_backward)  # begin_backward
                    n_issued += tr.at_backward
                for i, e, c, w, fixed, gb, eag, announced in zip(*records):
                    # ---- the model announces the modules it runs next: their reads queue now
                    for x, xw in announced:
                        announced_landing[x] = read(t, e_bytes[x], xw)
                    # ---- materialise the param: an NVMe param takes its entry's read; the
                    # prefetcher issues the next ones before it waits (see _prefetch)
                    if e >= 0:
                        if issued[e]:
                            prefetch(t, n_issued, issued[e])
                            n_issued += issued[e]
                        src = took[e]
                        if src != KEPT:  # (kept since its forward: no read)
                            if src >= 0:
                                done = landing[src]
                            elif e in announced_landing:
                                done = announced_landing.pop(e)
                            else:
                                done = read_urgent(t, e_bytes[e], w)
                            wait = (done - t if done > t else 0.0) + fixed
                            stall += wait
                            t += wait
                            if per_shard:
                                stall_of[i] += wait * repeat
                    elif fixed:  # a DRAM param copied to the device
                        stall += fixed
                        t += fixed
                        if per_shard:
                            stall_of[i] += fixed * repeat
                    # ---- eager mode: the group read is asked for at the module's backward pre-hook
                    if eag == EAGER_NVME and last and eager:
                        group_done[i] = read(t, g_bytes[i], g_reqs[i])
                    # ---- the gradient's sum so far is read back from its file from the same hook
                    if gb >= 0 and readback:
                        sum_done = read(t, gb, w)
                    # ---- compute
                    t += c
                    # ---- the gradient, final at the end of the module's backward, to its NVMe group
                    if gb >= 0:
                        if readback:  # it adds to the sum read back, once that has landed
                            d = sum_done
                            wait = d - t if d > t else 0.0
                            stall += wait
                            t += wait
                            if per_shard:
                                stall_of[i] += wait * repeat
                        if last and eager:
                            if eag == EAGER_NVME:
                                t = submit_update(t, i)
                        else:  # spilled behind backward: waits for window room, or for the whole
                            # write when there is no window (a stall, as the engine counts it)
                            d = write(t, gb, w)
                            stall += d - t
                            if per_shard:
                                stall_of[i] += (d - t) * repeat
                            t = d
                    elif eag == EAGER_DRAM and last:
                        t = submit_dram_update(t, i)
            # end of backward: chunks are updated now (eager), reads left in flight are dropped
            if last and eager:
                for i in tr.eager_chunks:
                    group_done[i] = read(t, g_bytes[i], g_reqs[i])
                    t = submit_update(t, i)
            if last:
                for i in tr.dram_eager_chunks:
                    t = submit_dram_update(t, i)
            for b in tr.dropped:
                wasted += b
            f_s, b_s = t_bwd_start - t_pass, t - t_bwd_start
            if repeat > 1:  # a middle pass stands for k - 2 identical ones
                extra = repeat - 1
                busy += extra * (busy - busy0)
                rbytes += extra * (rbytes - rb0)
                wbytes += extra * (wbytes - wb0)
                wasted += extra * (wasted - ws0)
                stall += extra * (stall - st0)
                t += extra * (t - t_pass)
            fwd_s += repeat * f_s
            bwd_s += repeat * b_s

        # -- the optimizer phase
        t_opt = t
        for d in queued + [dram_done]:  # updates queued during backward
            if d > t:
                t = d
        queued.clear()
        nvme_todo = tr.todo_nvme
        # the NVMe groups' reads, asked for when a group is reached: its own and with
        # pipeline_read the next one's
        ahead = 2 if wl.pipeline_read else 1
        n_groups = len(nvme_todo)
        lands = [0.0] * n_groups  # when they land
        asked = j = 0  # NVMe groups whose reads were asked for, reached
        for i, group, rewrite in zip(*tr.todo):
            if group:
                while asked < j + ahead and asked < n_groups:
                    g = nvme_todo[asked]
                    lands[asked] = read(t, gr_bytes[g], gr_reqs[g])
                    asked += 1
                if lands[j] > t:
                    t = lands[j]
                j += 1
            t += update_seconds[i]
            if group:  # the master and moments back
                t = write(t, g_bytes[i], g_reqs[i])
            if rewrite:  # the param file (from the master, or from the DRAM master)
                t = write(t, p_bytes[i], p_reqs[i])
        opt_s = t - t_opt

        # what is left on the disk delays the next step
        left = [f - t for f in free]
        writes_left = [(d - t, b) for d, b in wq if d > t]
        backlog_out = None
        if backlog is None and (max(left) > 1e-12 or writes_left):
            backlog_out = {"free": [max(0.0, x) for x in left], "writes": writes_left}
        return {
            "forward_s": fwd_s, "backward_s": bwd_s, "optimizer_s": opt_s, "stall_s": stall,
            "disk_busy_s": busy, "read_bytes": rbytes, "write_bytes": wbytes,
            "wasted_bytes": wasted, "backlog": backlog_out, "per_shard": stall_of,
        }


def simulate(workload: Workload, placement, cost_model, *, prefetch_bytes: int | None = None,
             reuse_distance_bytes: int | None = None, disk_servers: int | None = None, reissue_in_use: bool = False,
             write_window_bytes: int | None = None, per_shard: bool = False) -> Prediction:
    """Predict one steady-state step of ``workload`` under ``placement`` (see the module docstring).

    ``placement``: {shard: (param_tier, optim_tier)}, the engine's {shard: {"param": ...,
    "optim": ...}}, or {(shard, state): tier}; shards not named are on NVMe (pins kept).
    ``cost_model``: a :class:`planner.CostModel` (its ``nvme`` read and write costs are used).
    ``prefetch_bytes`` / ``reuse_distance_bytes`` / ``write_window_bytes``: override the
    workload's engine settings; ``disk_servers``: requests the disk serves at once;
    ``per_shard``: also return each shard's stall.
    """
    sim = Simulator(workload, cost_model, prefetch_bytes=prefetch_bytes, reuse_distance_bytes=reuse_distance_bytes,
                    disk_servers=disk_servers, reissue_in_use=reissue_in_use, write_window_bytes=write_window_bytes)
    return sim.predict(placement, per_shard=per_shard)


def calibrate(workload: Workload, cost_model, *, placement=None, measured_step_s: float | None = None,
              **simulate_kwargs) -> Workload:
    """The workload with ``overhead_s`` = measured step - simulated step of the measured placement.

    ``placement`` defaults to ``workload.measured_placement`` and ``measured_step_s`` to
    ``workload.measured_step_s``. The overhead is what the simulator does not model (the training
    loop's own code, hooks, Python, model error); it may be negative when the simulator
    overestimates. It is the same for every placement, so it moves absolute predictions, never
    the solver's choice.
    """
    placement = workload.measured_placement if placement is None else placement
    measured = workload.measured_step_s if measured_step_s is None else measured_step_s
    if placement is None or measured is None:
        from planner.workload import WorkloadError

        raise WorkloadError("calibrate needs a measured placement and step time (a workload from a profile, or pass both)")
    raw = simulate(workload.with_overhead(0.0), placement, cost_model, **simulate_kwargs)
    return workload.with_overhead(float(measured) - raw.step_s)
