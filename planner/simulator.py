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
window has room (and its next read is then skipped). Like ``zinf/prefetch.py`` today, the issuer
does not skip a shard that is materialised and in use, so a shard's backward read can be issued
while its forward runs and then be wasted when the shard is kept: ``Prediction.wasted_read_bytes``
(set ``reissue_in_use=False`` to model a prefetcher that skips it). A window smaller than the
largest NVMe param is 0, as the engine sizes it.

**Disk.** Every NVMe read and write - prefetches, misses, optimizer groups, gradients, param
rewrites - costs the cost model's ``latency + bytes x (1 / bandwidth + others x shared)`` per
request, where ``others`` is the number of the queue's requests still in flight when it starts
(the disk's sharing, fitted from each sample's concurrency; :mod:`planner.costmodel`). Asynchronous requests
(``read_async``/``write_async``: prefetches, misses, optimizer groups, writes behind) wait in one
FIFO queue served by ``disk_servers`` servers; synchronous ones (``store.read``/``store.write`` on
the calling thread: a gradient read back between micro-batches, any write when there is no write
window) start at once beside them, as in the store. The default is the engine's number of request
threads (``max(2, aio.thread_count)``: the NVMe store runs that many requests at once). A
synchronous request sees the queue's requests in flight as ``others`` too, so a placement that
writes synchronously while nothing else is in flight gets the disk alone (the cost model's profiles
without concurrency give ``shared`` = 0 and a per-request bandwidth under the run's own
concurrency: then every request costs the same, as before). Writes go through a window of ``write_window_bytes`` in flight (waiting for room blocks the writing thread);
0 makes them synchronous.

**Gradients and the optimizer.** A gradient whose optimizer home is NVMe is written to its file
after each micro-batch (asynchronously) and read back, synchronously, before the next one adds to
it. With ``updates_during_backward`` (``zinf.overlap_optimizer`` and no clipping) the last pass
updates NVMe groups on a worker thread while backward goes on: the group read is asked for at the
module's backward, the update queued when its gradient is final (the main thread waits when two
are queued), its write-back issued from the worker; chunks are queued when backward ends. On a CPU
device the worker's compute takes cores from the training thread: ``cpu_contention`` (1 there,
0 with a GPU) is the fraction of each such update charged to the main thread too. The
optimizer phase then waits for the worker and updates the rest in order on the main thread; for
NVMe groups (when not updated during backward) the read of the next group is in flight while the
current one is updated (``pipeline_read``) and write-backs run behind. An update takes
``update_overhead_s + numel x update_s_per_elem``; a trainable shard whose param is on NVMe in its
own file also rewrites it after the update. DRAM homes cost no I/O.

**Steady state and the step time.** The step is simulated twice when I/O is left over at its end:
the second time the disk starts with the first run's backlog (write-backs of the previous step
delay the next step's first reads). ``step_s = max(main thread, disk busy / servers) + overhead_s``: a
step cannot in the long run be shorter than the disk time it needs (``io_bound_s`` is the excess), and
``overhead_s`` is the workload's calibrated residual (:func:`calibrate`): the measured step minus
the simulation of the measured placement, so that the prediction of the placement the run is in
matches what was measured. It is one explicit number per workload, the same for every placement.

Not modelled: CPU contention other than ``cpu_contention``, page-cache effects, module
nesting (a parent's params held while children run), the real module trace (order is shard order),
the prefetcher's ``2 x window`` look-ahead limit, and reads of the gradient by clipping.

Units: seconds (``_s``), bytes (``_bytes``), bytes per second (``_Bps``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from planner.hotness import _per_access_compute, io_costs
from planner.workload import Workload, normalize_placement

__all__ = ["Prediction", "simulate", "calibrate", "Simulator"]

# tier codes used inside the simulation
P_RESIDENT, P_COPY, P_NVME = 0, 1, 2
O_NONE, O_DRAM, O_NVME = 0, 1, 2


@dataclass
class Prediction:
    """The simulated step of one placement (seconds per optimizer step; bytes per step)."""

    step_s: float
    """``max(main thread, disk busy / servers) + overhead_s``."""
    forward_s: float
    """Forward passes, stalls included."""
    backward_s: float
    """Backward passes, stalls included."""
    optimizer_s: float
    """The optimizer phase (waiting for updates queued during backward, then the rest)."""
    stall_s: float
    """Main-thread time waiting for params, gradients read back, queued updates (as the engine's
    ``stall_s`` counts it)."""
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
    per_shard_stall_s: pd.Series | None = None
    """Stall per step caused by each shard (param fetches and gradient read-backs), when asked."""

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


class Simulator:
    """A workload, a cost model and the engine settings, ready to simulate many placements.

    The per-shard arrays are prepared once; :meth:`run` takes tier codes (what the solver uses),
    :meth:`predict` a placement mapping.
    """

    def __init__(self, workload: Workload, cost_model, *, prefetch_bytes: int | None = None,
                 reuse_distance_bytes: int | None = None, disk_servers: int | None = None, reissue_in_use: bool = True,
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
        uo = np.clip(df["opt_accesses_per_step"].to_numpy(np.float64), 0.0, 1.0) * df["trainable"].to_numpy(bool)
        c_f, c_b = _per_access_compute(wl)
        self.P, self.O, self.G = P.tolist(), O.tolist(), G.tolist()
        self.group_bytes = (O + G)  # for the engine's write window
        self.chunk = df["chunk"].to_numpy(bool).tolist()
        self.trainable = df["trainable"].to_numpy(bool).tolist()
        self.files = np.divide(O, numel * 4, out=np.ones(n), where=numel > 0).tolist()  # master + moments
        self.uo = uo.tolist()
        self.update_s = (wl.update_overhead_s + numel * wl.update_s_per_elem).tolist()
        self.rf = np.minimum(wf, 1.0).tolist()  # read weight of a forward visit
        self.rb = np.minimum(wb, 1.0).tolist()
        self.c_f, self.c_b = c_f.tolist(), c_b.tolist()
        self.fwd_order = np.flatnonzero(wf > 0).tolist()
        self.bwd_order = np.flatnonzero(wb > 0)[::-1].tolist()
        self.compute_s = float(wl.compute_fwd_s + wl.compute_bwd_s + (uo * np.asarray(self.update_s)).sum())
        self.copy_s_per_byte = 0.0 if not math.isfinite(wl.copy_Bps) or wl.copy_Bps <= 0 else 1.0 / wl.copy_Bps

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
    def run(self, pc: list[int], oc: list[int], *, per_shard: bool = False) -> Prediction:
        """Simulate one steady-state step for tier codes ``pc`` (param) and ``oc`` (optim)."""
        first = self._step(pc, oc, None, per_shard)
        if first["backlog"] is not None:
            out = self._step(pc, oc, first["backlog"], per_shard)
        else:
            out = first
        wl = self.workload
        main_s = out["forward_s"] + out["backward_s"] + out["optimizer_s"]
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
            wasted_read_bytes=out["wasted_bytes"], per_shard_stall_s=stall,
        )

    def _write_window(self, oc: list[int]) -> int:
        if self.write_window_override is not None:
            return int(self.write_window_override)
        wl = self.workload
        if wl.write_window_bytes is not None:
            return int(wl.write_window_bytes)
        nv = [g for g, c in zip(self.group_bytes.tolist(), oc) if c == O_NVME]
        return int(2 * max(nv)) if nv else 0

    def _step(self, pc, oc, backlog, per_shard):  # noqa: C901 - one loop, commented inline
        io = self.io
        r_lat, w_lat = io.read_latency_s, io.write_latency_s
        # seconds per byte alone on the disk, and added per other request in flight
        r_spb, w_spb = io.read_alone_s_per_byte, io.write_alone_s_per_byte
        r_share, w_share = io.read_shared_s_per_byte, io.write_shared_s_per_byte
        wl = self.workload
        k = self.k
        P, O, G, files = self.P, self.O, self.G, self.files
        chunk, trainable, uo, upd = self.chunk, self.trainable, self.uo, self.update_s
        rf, rb, c_f, c_b = self.rf, self.rb, self.c_f, self.c_b
        fetch_over = wl.fetch_overhead_s
        copy_spb = self.copy_s_per_byte
        eager = wl.updates_during_backward
        master_file = wl.param_file_is_master
        n = self.n
        reissue = self.reissue_in_use
        contention = float(wl.cpu_contention)
        stall_of = [0.0] * n if per_shard else None

        # prefetch window: 0 when the largest NVMe param would not fit (as the engine sizes it)
        W = self.prefetch_bytes
        nvme_p = [i for i in range(n) if pc[i] == P_NVME]
        if nvme_p and W < max(P[i] for i in nvme_p):
            W = 0
        reuse_dist = self.reuse_distance_bytes
        cap = self._write_window(oc)

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
        # with a new one). Hot path: no sharing fitted -> nothing to count; two servers (the
        # default) -> two compares.
        if r_share == 0.0 and w_share == 0.0:
            def others(start: float) -> int:
                return 0
        elif servers == 2:
            def others(start: float) -> int:
                return (free[0] > start) + (free[1] > start)
        else:
            def others(start: float) -> int:
                return sum(1 for f in free if f > start)

        def read(t: float, nbytes: float, requests: float = 1.0) -> float:
            """Queue a read at time t; returns when it lands."""
            nonlocal busy, rbytes
            f = free[0]
            start = t if t > f else f
            dur = requests * r_lat + nbytes * (r_spb + others(start) * r_share)
            busy += dur
            rbytes += nbytes
            end = start + dur
            heapreplace(free, end)
            return end

        def read_now(t: float, nbytes: float, requests: float = 1.0) -> float:
            """A synchronous read on the calling thread (``store.read``): it does not wait in the
            request queue; it runs beside whatever the request threads are doing."""
            nonlocal busy, rbytes
            dur = requests * r_lat + nbytes * (r_spb + others(t) * r_share)
            busy += dur
            rbytes += nbytes
            return t + dur

        def write(t: float, nbytes: float, requests: float = 1.0) -> float:
            """Write from a thread at time t; returns when that thread may go on."""
            nonlocal busy, wbytes, wq_bytes
            if nbytes <= 0:
                return t
            wbytes += nbytes
            if cap <= 0:  # synchronous: store.write on the calling thread, not queued
                dur = requests * w_lat + nbytes * (w_spb + others(t) * w_share)
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
            dur = requests * w_lat + nbytes * (w_spb + others(start) * w_share)
            busy += dur
            end = start + dur
            heapreplace(free, end)
            heappush(wq, (end, nbytes))
            wq_bytes += nbytes
            return t

        t = 0.0
        stall = 0.0
        fwd_s = bwd_s = 0.0
        # updates during backward: a worker thread and the main thread's queue of two
        worker_free = 0.0
        queued: list[float] = []  # completion times of updates submitted, oldest first
        group_done: dict[int, float] = {}  # NVMe group reads in flight -> landing time

        def submit_update(t: float, i: int) -> float:
            nonlocal worker_free, stall
            while len(queued) >= 2:  # the engine waits for the oldest when two are queued
                d = queued.pop(0)
                if d > t:
                    stall += d - t
                    t = d
            start = max(worker_free, t, group_done.pop(i, t))
            end = start + uo[i] * upd[i]
            t += contention * uo[i] * upd[i]  # the worker's compute takes cores from the main thread
            tw = write(end, uo[i] * O[i], uo[i] * files[i])
            if pc[i] == P_NVME and not master_file:
                tw = write(tw, uo[i] * P[i], uo[i])
            worker_free = tw
            queued.append(tw)
            return t

        # the NVMe trace of a pass: forward visits of NVMe params, backward visits of NVMe
        # one-parameter shards (a chunk is held for the whole pass)
        records = [(i, False) for i in self.fwd_order] + [(i, True) for i in self.bwd_order]
        e_shard: list[int] = []
        e_bytes: list[float] = []
        e_w: list[float] = []  # expected reads of the entry per pass (< 1: used in some passes only)
        entry_of: list[int] = []
        bwd_entry: dict[int, int] = {}
        for i, is_bwd in records:
            if pc[i] == P_NVME and not (is_bwd and chunk[i]):
                entry_of.append(len(e_shard))
                if is_bwd:
                    bwd_entry[i] = len(e_shard)
                e_shard.append(i)
                e_w.append(rb[i] if is_bwd else rf[i])
                e_bytes.append(P[i] * e_w[-1])
            else:
                entry_of.append(-1)
        E = len(e_shard)
        cum = [0.0] * (E + 1)
        for e in range(E):
            cum[e + 1] = cum[e] + e_bytes[e]

        # -- the passes: first / middle / middle (x k-3) / last
        # (a middle pass is simulated once as is, then once more for the other k - 3: the second
        # starts with the disk backlog a middle pass leaves, the steady state of the passes between)
        kinds = [("last", 1)] if k == 1 else [("first", 1)] + [("middle", 1)] * min(1, k - 2) + \
            [("middle", k - 3)] * (k > 3) + [("last", 1)]
        for kind, repeat in kinds:
            t_pass = t
            busy0, rb0, wb0, ws0, st0 = busy, rbytes, wbytes, wasted, stall
            last = kind == "last"
            # prefetcher state
            inflight: dict[int, tuple] = {}  # shard -> (entry, landing time, bytes)
            heap: list[tuple[int, int]] = []  # (entry, shard) of reads in flight, for dropping passed ones
            kept: dict[int, float] = {}
            used = [0.0]  # window bytes: in flight + kept
            pos = 0
            scan = [0]  # first entry not yet looked at by the issuer
            deferred: list[int] = []  # entries skipped because their shard was busy
            in_use = [-1]

            def try_issue(e: int, t: float) -> int:
                """1 issued/covered, 0 stop (no room), -1 defer (shard busy)."""
                s = e_shard[e]
                if s in kept:
                    return 1
                if s in inflight or (s == in_use[0] and not reissue):
                    return -1
                b = e_bytes[e]
                if used[0] + b > W:
                    return 0
                inflight[s] = (e, read(t, b, e_w[e]), b)
                heappush(heap, (e, s))
                used[0] += b
                return 1

            def issue(t: float) -> None:
                if W <= 0:
                    return
                if deferred:
                    rest = []
                    for j, e in enumerate(deferred):
                        if e < pos:
                            continue
                        r = try_issue(e, t)
                        if r == 0:
                            rest.extend(deferred[j:])
                            deferred[:] = rest
                            return
                        if r == -1:
                            rest.append(e)
                    deferred[:] = rest
                if scan[0] < pos:
                    scan[0] = pos
                while scan[0] < E:
                    r = try_issue(scan[0], t)
                    if r == 0:
                        return
                    if r == -1:
                        deferred.append(scan[0])
                    scan[0] += 1

            def drop_passed() -> None:
                nonlocal wasted
                while heap and heap[0][0] < pos - 1:
                    e, s = heappop(heap)
                    f = inflight.get(s)
                    if f is not None and f[0] == e:
                        del inflight[s]
                        used[0] -= f[2]
                        wasted += f[2]

            issue(t)  # begin_pass
            t_bwd_start = None
            for r, (i, is_bwd) in enumerate(records):
                if is_bwd and t_bwd_start is None:
                    t_bwd_start = t
                w = rb[i] if is_bwd else rf[i]
                e = entry_of[r]
                code = pc[i]
                # ---- materialise the param
                if e >= 0:
                    in_use[0] = i
                    if i in kept:  # kept since its forward: no read
                        used[0] -= kept.pop(i)
                        pos = e + 1
                        drop_passed()
                        issue(t)
                    else:
                        f = inflight.pop(i, None)
                        if f is not None:
                            used[0] -= f[2]
                        pos = e + 1
                        drop_passed()
                        issue(t)  # the engine issues before it waits
                        done = f[1] if f is not None else read(t, e_bytes[e], e_w[e])
                        wait = (done - t if done > t else 0.0) + w * (fetch_over + P[i] * copy_spb)
                        stall += wait
                        t += wait
                        if per_shard:
                            stall_of[i] += wait * repeat
                elif code == P_COPY and w > 0 and not (is_bwd and chunk[i]):
                    wait = w * (fetch_over + P[i] * copy_spb)
                    stall += wait
                    t += wait
                    if per_shard:
                        stall_of[i] += wait * repeat
                # ---- eager mode: the group read is asked for at the module's backward pre-hook
                if is_bwd and last and eager and oc[i] == O_NVME and not chunk[i] and uo[i] > 0:
                    group_done[i] = read(t, uo[i] * O[i], uo[i] * files[i])
                # ---- compute
                t += c_b[i] if is_bwd else c_f[i]
                # ---- release: keep it for its backward use when the window has room
                if e >= 0:
                    in_use[0] = -1
                    if not is_bwd and W > 0 and reuse_dist > 0 and not chunk[i]:
                        e2 = bwd_entry.get(i)
                        if e2 is not None and cum[e2] - cum[pos] <= reuse_dist:
                            b2 = e_bytes[e2]
                            if used[0] + b2 <= W:
                                kept[i] = b2
                                used[0] += b2
                # ---- the gradient, final at the end of the module's backward
                if is_bwd and trainable[i] and oc[i] == O_NVME:
                    gb = G[i] * w
                    if kind != "first" and k > 1:  # the sum so far comes back from its file first
                        d = read_now(t, gb, w)
                        wait = d - t if d > t else 0.0
                        stall += wait
                        t += wait
                        if per_shard:
                            stall_of[i] += wait * repeat
                    if last and eager:
                        if not chunk[i] and uo[i] > 0:
                            t = submit_update(t, i)
                    else:
                        t = write(t, gb, w)  # spilled behind backward (waits only for window room)
            if t_bwd_start is None:
                t_bwd_start = t
            # end of backward: chunks are updated now (eager), reads left in flight are dropped
            if last and eager:
                for i in range(n):
                    if chunk[i] and oc[i] == O_NVME and uo[i] > 0:
                        group_done[i] = read(t, uo[i] * O[i], uo[i] * files[i])
                        t = submit_update(t, i)
            for f in inflight.values():
                wasted += f[2]
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
        for d in queued:  # updates queued during backward
            if d > t:
                t = d
        queued.clear()
        todo = [i for i in range(n) if uo[i] > 0 and oc[i] != O_NONE and not (eager and oc[i] == O_NVME)]
        nvme_todo = [i for i in todo if oc[i] == O_NVME]
        nvme_index = {i: j for j, i in enumerate(nvme_todo)}
        ahead = 2 if wl.pipeline_read else 1  # this group's read, and with pipeline_read the next one's
        asked = 0
        reads: dict[int, float] = {}
        for i in todo:
            if oc[i] == O_NVME:
                while asked < min(nvme_index[i] + ahead, len(nvme_todo)):
                    j = nvme_todo[asked]
                    reads[j] = read(t, uo[j] * (O[j] + G[j]), uo[j] * (files[j] + 1))  # master, moments, spilled gradient
                    asked += 1
                d = reads.pop(i)
                if d > t:
                    t = d
            t += uo[i] * upd[i]
            if oc[i] == O_NVME:
                t = write(t, uo[i] * O[i], uo[i] * files[i])
                if pc[i] == P_NVME and not master_file:
                    t = write(t, uo[i] * P[i], uo[i])
            elif pc[i] == P_NVME:
                t = write(t, uo[i] * P[i], uo[i])  # refresh the param file from the DRAM master
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
             reuse_distance_bytes: int | None = None, disk_servers: int | None = None, reissue_in_use: bool = True,
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
