"""The profiler's recorder: engine events in, batched rows in the profile database out.

``Recorder.emit`` runs on the training thread (the engine sends its I/O samples once a step, as
an :class:`IoBatch`; an :class:`IoDone` may come from any thread) and does one thing: append the event to a bounded buffer (:class:`_EventBuffer`). A background thread takes
the events off, aggregates them in memory per step (``steps``) and per window of ``window_steps`` steps
(``shard_steps``: accesses by phase, bytes by tier, fetch/stall/optimizer seconds per shard), and
writes them in batches (``executemany``, one transaction per batch) every ``flush_interval_s``.

Overload: when ``queue_max`` events are waiting, detail events (:class:`ShardFetched`,
:class:`ShardTransfer`, :class:`IoDone`, :class:`IoBatch`, :class:`OptimizerShardDone`) are dropped at once
(a batch counts as its requests); the few per-step events
(:class:`RunStarted`, :class:`StepFinished`, :class:`ShardMigrated`, :class:`RunFinished`) may
use a reserve above ``queue_max`` and wait at most ``essential_wait_s`` for room before they are
dropped too. Every drop is counted per event kind, in :attr:`Recorder.dropped` and in the run's
``dropped_events`` column. I/O samples beyond ``io_samples_per_step`` in one step are subsampled
(reservoir sampling) and counted as ``"IoDone:subsampled"`` there.

Step attribution: detail events belong to the step whose :class:`StepFinished` comes next (the
engine's ``ShardFetched.step`` is ``global_steps`` *before* the step, ``StepFinished.step`` the
value after it; rows carry the latter). ``shard_steps.step`` is the first step of its window.
Detail events after the last step of a run (e.g. evaluation forwards) are not attributed to any
step and are counted as ``"unattributed"``; their I/O samples are kept, with step = last + 1.

Status: ``finished``/``crashed`` as :class:`RunFinished` says; closed without a RunFinished ->
``crashed``; a process that died leaves ``running``, which :func:`profiler.queries.list_runs`
reports as ``crashed`` once its pid is gone (same host) or its heartbeat is stale.

What a killed process loses: only what was not yet committed. A step's ``steps`` row, its
``shard_steps`` rows (of a window that closed with it) and its I/O samples go into the database
in one transaction, at most ``flush_interval_s`` after its :class:`StepFinished` (plus the time
of that write), so a SIGKILL loses at most the steps finished in the last ``flush_interval_s``
and the step under way; an open window of ``window_steps`` > 1 loses its shard rows. While
writes fail (a locked database) rows wait in memory and retries back off up to 30 s: then
everything since the last commit is at risk. ``last_heartbeat`` is at most ``heartbeat_s`` old
while the process lives. SQLite's WAL keeps every commit intact across the kill.

Sampled shard detail (:meth:`Recorder.set_shard_detail_every`, default off): with ``k`` > 1 the
recorder takes the detail events of one step in ``k`` and ignores the others - and tells the
engine so through the plain attribute :attr:`Recorder.shard_detail_now`, which it checks before it
builds an event, so an unsampled step builds, queues, aggregates and writes nothing. A sampled
step stands for itself and the unsampled steps since the previous sampled one (its ``span``, at
most ``k``): its ``shard_steps`` row is a window of ``span`` steps ending with it (``step`` = its
first step, ``window_steps`` = ``span``) whose counts, bytes and seconds are the sampled step's
times ``span``. Every reader that divides a window by its ``window_steps`` (accesses per step,
:func:`profiler.queries.shard_access_stats`, :func:`planner.hotness.access_rates`) then gets the
sampled step's per-step values, and sums over a run estimate its totals. Exact for a workload whose
accesses are the same every step (a dense model: the planner samples only then); an estimate
otherwise. Rows only ever cover steps already run, so a sampled run's newest row may end a few
steps before its newest ``steps`` row. Only with ``window_steps`` = 1. The I/O samples
(``io_samples``) and the measured I/O totals in ``runs.bandwidths`` come from the sampled steps
only (the bandwidths, ratios of the two, stay right; ``*_bytes`` and ``*_s`` undercount).

``runs.bandwidths``: what :meth:`Recorder.record_bandwidths` (or ``hardware["bandwidths"]``)
gave, plus, per tier and op, what this run's I/O measured (every :class:`IoDone`, subsampled
or not): ``<tier>_<op>_bytes``, ``<tier>_<op>_s`` (summed request seconds) and
``<tier>_<op>_GBps`` (their ratio), e.g. ``nvme_read_GBps``; given values win.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import random
import socket
import threading
import time
from collections import Counter, deque
from typing import Any, Iterable, Mapping

import sqlalchemy as sa

from zinf import events as ev
from zinf.errors import ConfigError, ProfileError

from profiler import schema
from profiler.store import describe_url, make_engine, pid_start_ticks, upgrade

log = logging.getLogger("zinf.profiler")

__all__ = ["Recorder", "record_calibration", "DETAIL_EVENTS", "MAX_SHARD_DETAIL_EVERY"]

MAX_SHARD_DETAIL_EVERY = 64
"""The longest span a sampled shard-detail row may stand for (:meth:`Recorder.set_shard_detail_every`):
readers that need the rows covering a step look back at most this many steps."""

DETAIL_EVENTS = (ev.ShardFetched, ev.ShardTransfer, ev.IoDone, ev.IoBatch, ev.OptimizerShardDone)
_DETAIL = frozenset(DETAIL_EVENTS)
# events that belong to an open run (dropped, and counted as "no_run:<kind>", when none is open)
_NEEDS_RUN = _DETAIL | {ev.StepFinished, ev.ShardMigrated, ev.RunFinished}
_PHASE_INDEX = {"forward": 0, "backward": 1, "recompute": 2}
_TIER_INDEX = {t: i for i, t in enumerate(schema.TIERS)}

# Layout of a per-shard window accumulator (a plain list: cheap to update).
_FWD, _BWD, _REC, _OPT = 0, 1, 2, 3
_READ0 = 4  # read bytes per tier: 4, 5, 6
_WRITE0 = 4 + len(schema.TIERS)  # written bytes per tier: 7, 8, 9
_FETCH_S = _WRITE0 + len(schema.TIERS)
_STALL_S = _FETCH_S + 1
_OPTIM_S = _STALL_S + 1
_OVERHEAD_S = _OPTIM_S + 1  # the fetches' stall beyond waiting for their reads
_UPDATE_S = _OVERHEAD_S + 1  # of _OPTIM_S, the updates alone
_ACC_LEN = _UPDATE_S + 1

_CALIBRATION_COLUMNS = tuple(c.name for c in schema.calibrations.columns if c.name != "id")


def _new_acc() -> list:
    acc: list = [0] * _ACC_LEN
    acc[_FETCH_S] = acc[_STALL_S] = acc[_OPTIM_S] = acc[_OVERHEAD_S] = acc[_UPDATE_S] = 0.0
    return acc


class _EventBuffer:
    """The bounded FIFO between the threads that emit and the writer thread.

    A ``queue.Queue`` wakes its consumer on every put. With ~350 detail events per step of the
    demo, that cost ~22 us per emit on the training thread and a writer wake-up (and GIL
    hand-over) per event: most of the profiler's overhead. Here a put is a ``deque.append`` and
    only a put with ``wake`` (the few per-step events, commands, flush and stop markers) or one
    that fills the buffer past ``wake_at`` wakes the writer, which then drains everything.
    The bound is checked without a lock, so concurrent producers may overshoot it by one each.
    """

    def __init__(self, maxsize: int, wake_at: int) -> None:
        self._items: deque = deque()
        self.maxsize = maxsize
        self._wake_at = wake_at
        self._ready = threading.Event()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Any, wake: bool = True) -> None:
        if len(self._items) >= self.maxsize:
            raise queue.Full
        self._items.append(item)
        if wake or len(self._items) >= self._wake_at:
            self._ready.set()

    def put(self, item: Any, timeout: float, wake: bool = True) -> None:
        """:meth:`put_nowait`, waiting up to ``timeout`` s for room (polling: a full buffer is
        rare, and the writer is already awake draining it)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.put_nowait(item, wake)
            except queue.Full:
                if time.monotonic() >= deadline:
                    raise
                self._ready.set()
                time.sleep(0.001)

    def get_nowait(self) -> Any:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float | None = None) -> Any:
        """The oldest item, waiting up to ``timeout`` s (None: forever) for a wake-up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise queue.Empty
            if not self._ready.wait(left) and not self._items:
                raise queue.Empty
            self._ready.clear()  # cleared before the next popleft: a put after it sets it again


class _Flush:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None


class _Stop:
    __slots__ = ()


class _Command:
    """A record_* call, carried through the queue so it is ordered with the events."""

    __slots__ = ("kind", "payload")

    def __init__(self, kind: str, payload: Any) -> None:
        self.kind = kind
        self.payload = payload


class _Span:
    """Put before a sampled step's :class:`ev.StepFinished`: the steps that step stands for."""

    __slots__ = ("steps",)

    def __init__(self, steps: int) -> None:
        self.steps = steps


class _RunState:
    """What the writer knows about one run while recording it."""

    def __init__(self, started: ev.RunStarted) -> None:
        self.started = started
        self.run_id: int | None = None
        self.shard_ids: dict[str, int] = {}
        self.known = {s.name for s in started.shards}
        self.tiers = {s.name: [s.param_tier, s.optim_tier] for s in started.shards}
        # migrations made after a step's work but before its StepFinished (the planner's, between
        # steps): (shard, 0 param / 1 optim, new tier, step), applied once that step's row is
        # closed, so that the row keeps the tiers its accesses ran on
        self.moved_after_step: list[tuple[str, int, str, int]] = []
        self.cur: dict[str, list] = {}  # since the last StepFinished
        self.window: dict[str, list] = {}  # finished steps of the open window
        self.window_first: int | None = None
        self.window_count = 0
        self.span = 1  # steps the step under way stands for (> 1: a sampled step, see _Span)
        self.io_buf: list[dict] = []
        self.io_seen = 0
        self.io_subsampled = 0
        self.unattributed = 0
        self.last_step: int | None = None
        self.plan_version = 0
        self.finished = False
        self.update: dict[str, Any] = {}
        self.dropped_base: Counter = Counter()
        hw_bw = started.hardware.get("bandwidths") if isinstance(started.hardware, Mapping) else None
        self.bandwidths_given: dict[str, Any] = dict(hw_bw) if isinstance(hw_bw, Mapping) else {}
        self.io_totals: dict[tuple[str, str], list] = {}  # (tier, op) -> [bytes, seconds]
        self.io_totals_changed = False

    def bandwidths(self) -> dict[str, Any] | None:
        """runs.bandwidths: the measured totals of this run's I/O, under what was given."""
        out: dict[str, Any] = {}
        for (tier, op), (nbytes, secs) in sorted(self.io_totals.items()):
            out[f"{tier}_{op}_bytes"] = nbytes
            out[f"{tier}_{op}_s"] = secs
            out[f"{tier}_{op}_GBps"] = nbytes / secs / 1e9 if secs > 0 else None
        out.update(self.bandwidths_given)
        return out or None

    def acc_of(self, shard: str) -> list:
        """The accumulator of ``shard`` for the step under way (created on first use)."""
        acc = self.cur.get(shard)
        if acc is None:
            acc = self.cur[shard] = _new_acc()
        return acc

    @property
    def next_step(self) -> int:
        return (self.last_step + 1) if self.last_step is not None else 0


class Recorder:
    """Records a training run into the profile database at ``url`` (implements ``zinf.events.Recorder``).

    ``detail="shard"`` records ``steps``, ``shard_steps`` and ``io_samples``; ``detail="step"``
    only ``steps`` (and runs, shards, migrations, plans) and ignores the detail events in ``emit``.
    The database is created or migrated on open (:func:`profiler.store.upgrade`).

    Pending rows are committed every ``flush_interval_s`` (and a heartbeat every ``heartbeat_s``):
    a process killed without warning loses at most the steps finished in its last
    ``flush_interval_s`` and the step under way (see the module docstring for the exceptions).
    """

    enabled = True

    def __init__(
        self,
        url: str,
        *,
        detail: str = "shard",
        window_steps: int = 1,
        queue_max: int = 10_000,
        flush_interval_s: float = 0.5,
        io_samples_per_step: int = 1_000,
        heartbeat_s: float = 5.0,
        essential_wait_s: float = 0.25,
        seed: int = 0,
    ) -> None:
        detail = str(detail).lower()
        if detail not in ("shard", "step"):
            raise ConfigError(f"profiler detail must be 'shard' or 'step', got {detail!r}")
        if int(window_steps) < 1:
            raise ConfigError(f"profiler window_steps must be >= 1, got {window_steps!r}")
        if int(queue_max) < 1:
            raise ConfigError(f"profiler queue_max must be >= 1, got {queue_max!r}")
        if flush_interval_s < 0:
            raise ConfigError(f"profiler flush_interval_s must be >= 0, got {flush_interval_s!r}")
        self.url = url
        self.detail = detail
        self.window_steps = int(window_steps)
        self.queue_max = int(queue_max)
        self.flush_interval_s = float(flush_interval_s)
        self.io_samples_per_step = max(0, int(io_samples_per_step))
        self.heartbeat_s = max(0.05, float(heartbeat_s))
        self.essential_wait_s = max(0.0, float(essential_wait_s))
        self._shard_detail = detail == "shard"
        # shard-detail sampling (training thread only; see set_shard_detail_every)
        self.shard_detail_now = self._shard_detail
        """Whether the detail events of the step under way are recorded (read by the engine before
        it builds one; False in the steps that sampling skips, and always with ``detail="step"``)."""
        self._detail_every = 1
        self._last_sampled: int | None = None  # StepFinished.step of the newest sampled step
        self._span_now = 1  # steps the step under way stands for, if it is sampled
        self._shown = describe_url(url)

        self._engine = make_engine(url)
        try:
            upgrade(self._engine)
        except BaseException:
            self._engine.dispose()
            raise

        # detail events use up to queue_max slots; the per-step events have a reserve above that
        self._reserve = max(64, self.queue_max // 10)
        self._q = _EventBuffer(self.queue_max + self._reserve, wake_at=max(1, self.queue_max // 2))
        self._dropped: Counter = Counter()
        self._drop_lock = threading.Lock()
        self._closed = False
        self._dead = False
        self._rng = random.Random(seed)

        # writer-thread state
        self._state: _RunState | None = None
        self._states_to_update: dict[int, _RunState] = {}
        self._rows: dict[str, list[tuple[_RunState | None, dict, str | None]]] = {
            name: [] for name in ("steps", "shard_steps", "io_samples", "migrations", "tuning_trials", "calibrations")
        }
        self._starts: list[_RunState] = []
        self._plans: list[tuple[_RunState | None, dict, list]] = []
        self._n_pending = 0
        self._last_write = time.monotonic()
        self._last_heartbeat = 0.0
        self._retry_at = 0.0
        self._fail_streak = 0
        self.last_error: str | None = None
        self.rows_written = 0

        self._run_id: int | None = None
        self._run_cond = threading.Condition()
        self._starts_queued = 0  # RunStarted events queued / written, for wait_run_id
        self._starts_written = 0
        self._thread = threading.Thread(target=self._run, name="zinf-profiler-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ training-thread API
    def emit(self, event: ev.Event) -> None:
        """Queue ``event`` for the writer; never blocks for long, drops (and counts) on overload."""
        if self._closed or self._dead:
            if not self._closed:
                self._drop_event(event)
            return
        q = self._q
        if type(event) in _DETAIL:
            if not self.shard_detail_now:  # detail "step", or a step that sampling skips
                return
            if q.qsize() >= self.queue_max:
                self._drop_event(event)
                return
            try:
                q.put_nowait(event, wake=False)  # aggregated at the step's end: no hurry
            except queue.Full:
                self._drop_event(event)
            return
        if type(event) is ev.StepFinished and self.shard_detail_now and self._span_now > 1:
            try:  # with the step's own event: dropped, the row counts one step (and is counted)
                q.put_nowait(_Span(self._span_now))
            except queue.Full:
                self._drop("span")
        try:
            q.put_nowait(event)
        except queue.Full:
            try:
                q.put(event, timeout=self.essential_wait_s)
            except queue.Full:
                self._drop_event(event)
                return
        if type(event) is ev.RunStarted:
            with self._run_cond:
                self._starts_queued += 1
            self._last_sampled, self._span_now = None, 1
            self.shard_detail_now = self._shard_detail
        elif type(event) is ev.StepFinished and self._shard_detail:
            self._next_sample(int(event.step))

    def set_shard_detail_every(self, k: int) -> int:
        """Record the shard detail of one step in ``k`` (1: every step; at most
        :data:`MAX_SHARD_DETAIL_EVERY`) from now on; see "Sampled shard detail" in the module
        docstring. Call it on the training thread (a planner's step hook does). It decides from
        the next step on, never for the step under way (whose events may be queued already): the
        next step is sampled once ``k`` steps have passed since the last sampled one, so a smaller
        ``k`` takes effect with the next step. Returns the ``k`` in force: always 1 with
        ``window_steps`` > 1 (windows and sampling do not mix) or ``detail="step"``."""
        k = max(1, min(int(k), MAX_SHARD_DETAIL_EVERY))
        if self.window_steps > 1 or not self._shard_detail:
            k = 1
        self._detail_every = k
        return k

    @property
    def shard_detail_every(self) -> int:
        """The sampling period in force (:meth:`set_shard_detail_every`)."""
        return self._detail_every

    def _next_sample(self, step: int) -> None:
        """After ``StepFinished(step)`` was queued: whether the next step is sampled, and for how many steps."""
        if self.shard_detail_now:
            self._last_sampled = step
        span = (step + 1 - self._last_sampled) if self._last_sampled is not None else 1
        self._span_now = span
        self.shard_detail_now = span >= self._detail_every

    def _drop_event(self, event: Any, prefix: str = "") -> None:
        """Count ``event`` as dropped: an :class:`IoBatch` as the requests it carries."""
        if type(event) is ev.IoBatch:
            self._drop(f"{prefix}IoDone", len(event.requests))
        else:
            self._drop(f"{prefix}{type(event).__name__}")

    def _drop(self, kind: str, n: int = 1) -> None:
        with self._drop_lock:
            self._dropped[kind] += n

    @property
    def dropped(self) -> dict[str, int]:
        """Events dropped so far, by kind (queue overflow, writer failure, no run open)."""
        with self._drop_lock:
            return dict(self._dropped)

    @property
    def run_id(self) -> int | None:
        """Id of the run being recorded, once its RunStarted has been written (else None)."""
        return self._run_id

    def wait_run_id(self, timeout: float = 10.0) -> int:
        """The id of the run last started, waiting up to ``timeout`` s for its RunStarted to be written."""
        with self._run_cond:
            want = max(1, self._starts_queued)
            ok = self._run_cond.wait_for(lambda: self._starts_written >= want, timeout)
        if not ok:
            why = f" (last error: {self.last_error})" if self.last_error else ""
            raise ProfileError(
                f"no run recorded in {self._shown} within {timeout:g} s{why}; "
                "emit RunStarted first, and check that the database is writable"
            )
        assert self._run_id is not None
        return self._run_id

    def flush(self, timeout: float = 60.0) -> None:
        """Block until every event emitted so far is written (complete steps and windows)."""
        if not self._thread.is_alive():
            if self.last_error:
                raise ProfileError(f"profile writer for {self._shown} has stopped: {self.last_error}")
            return
        marker = _Flush()
        try:
            self._q.put(marker, timeout=timeout)
        except queue.Full:
            raise ProfileError(f"profile writer for {self._shown} is not draining its queue; is the database locked?") from None
        if not marker.done.wait(timeout):
            raise ProfileError(
                f"profile writer for {self._shown} did not flush within {timeout:g} s"
                + (f" (last error: {self.last_error})" if self.last_error else "")
                + "; check that the database is not locked by another writer"
            )
        if marker.error:
            raise ProfileError(f"writing the profile to {self._shown} failed: {marker.error}; check disk space and permissions")

    def close(self, timeout: float = 30.0) -> None:
        """Flush, mark an unfinished run ``crashed``, stop the writer. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover
            pass
        if self._thread.is_alive():
            try:
                self._q.put(_Stop(), timeout=timeout)
            except queue.Full:  # pragma: no cover - a writer stuck for `timeout` seconds
                log.warning("profiler: writer for %s is stuck; events still queued are lost", self._shown)
            self._thread.join(timeout)
            if self._thread.is_alive():  # pragma: no cover
                log.warning("profiler: writer for %s did not stop within %.0f s", self._shown, timeout)
                return
        self._engine.dispose()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ planner / autotuner API
    def record_plan(
        self,
        version: int,
        assignments: Iterable[Mapping[str, Any] | tuple] = (),
        *,
        policy: str,
        created_step: int = 0,
        dram_budget_bytes: int | None = None,
        predicted_step_s: float | None = None,
        predicted_gain_s: float | None = None,
        adopted: bool = False,
        reason: Any = None,
    ) -> None:
        """Queue a placement plan of the current run and its per-shard assignments.

        ``assignments``: mappings with ``shard`` (name), ``param_tier``, ``optim_tier`` and
        optionally ``score``, or tuples ``(shard, param_tier, optim_tier[, score])``. An adopted plan
        becomes the plan version of the migrations recorded after it.
        """
        rows = []
        for a in assignments:
            if isinstance(a, Mapping):
                rows.append((str(a["shard"]), str(a["param_tier"]), str(a["optim_tier"]), a.get("score")))
            else:
                a = tuple(a)
                rows.append((str(a[0]), str(a[1]), str(a[2]), a[3] if len(a) > 3 else None))
        plan = {
            "version": int(version),
            "created_step": int(created_step),
            "created_at": time.time(),
            "policy": str(policy),
            "dram_budget_bytes": None if dram_budget_bytes is None else int(dram_budget_bytes),
            "predicted_step_s": predicted_step_s,
            "predicted_gain_s": predicted_gain_s,
            "adopted": bool(adopted),
            "reason": reason,
        }
        self._command("plan", (plan, rows))

    def record_tuning_trial(self, setting: Mapping[str, Any], step_s: float | None, *, chosen: bool = False, step: int | None = None) -> None:
        """Queue one autotuner trial (``setting`` as JSON, its measured ``step_s``)."""
        self._command("trial", {"setting": dict(setting), "step_s": step_s, "chosen": bool(chosen), "step": step, "created_at": time.time()})

    def record_calibration(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Queue bench-io results (see :func:`record_calibration`)."""
        self._command("calibration", [_calibration_row(r) for r in rows])

    def record_bandwidths(self, bandwidths: Mapping[str, Any]) -> None:
        """Queue the measured bandwidths of the current run (stored in ``runs.bandwidths``)."""
        self._command("bandwidths", dict(bandwidths))

    def _command(self, kind: str, payload: Any) -> None:
        if self._closed:
            raise ProfileError(f"the profile recorder for {self._shown} is closed")
        try:
            self._q.put(_Command(kind, payload), timeout=max(1.0, self.essential_wait_s))
        except queue.Full:
            self._drop(f"record_{kind}")

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # pragma: no cover - a bug; keep training alive
            self._dead = True
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("profiler: writer thread for %s died", self._shown)

    def _loop(self) -> None:
        q = self._q
        stop = False
        while not stop:
            now = time.monotonic()
            st = self._state
            if self._n_pending:
                deadline: float | None = max(self._last_write + self.flush_interval_s, self._retry_at)
            elif st is not None and not st.finished:
                deadline = max(self._last_heartbeat + self.heartbeat_s, self._retry_at)
            else:
                deadline = None  # nothing to write and no run to keep alive: sleep until an event
            try:
                item = q.get(timeout=None if deadline is None else max(0.0, deadline - now))
            except queue.Empty:
                item = None
            urgent = False
            markers: list[_Flush] = []
            n = 0
            while item is not None:
                if isinstance(item, _Stop):
                    stop = True
                    break
                if isinstance(item, _Flush):
                    markers.append(item)
                    urgent = True
                else:
                    try:
                        urgent |= self._handle(item)
                    except Exception as e:  # a malformed event must not stop the recording
                        self._drop(f"invalid:{type(item).__name__}")
                        log.warning("profiler: cannot record %r: %s", item, e)
                n += 1
                if n >= 20_000:
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
            now = time.monotonic()
            if stop:
                self._finish_all()
                ok = self._write()
                if not ok:  # one more try after a moment: this is the last chance
                    time.sleep(0.5)
                    ok = self._write()
            elif (
                urgent
                or (self._n_pending and now - self._last_write >= self.flush_interval_s and now >= self._retry_at)
                or (self._state is not None and not self._state.finished and now - self._last_heartbeat >= self.heartbeat_s)
                or self._n_pending >= 50_000
            ):
                if urgent or now >= self._retry_at:
                    ok = self._write()
                else:
                    ok = False
            else:
                ok = True
            for m in markers:
                if not ok:
                    m.error = self.last_error or "write failed"
                m.done.set()
        # anything still waiting (flush markers after the stop) must not hang its caller
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Flush):
                item.done.set()

    # -- event handling (writer thread only) -----------------------------------------------
    def _handle(self, e: Any) -> bool:
        """Aggregate one event; True when it should be written at once."""
        kind = type(e)
        st = self._state
        if kind in _NEEDS_RUN and (st is None or st.finished):
            self._drop_event(e, "no_run:")
            return False
        if kind is ev.ShardFetched:
            acc = st.acc_of(e.shard)
            p = _PHASE_INDEX.get(e.phase)
            if p is not None:
                acc[p] += 1
            t = _TIER_INDEX.get(e.tier)
            if t is not None:
                acc[_READ0 + t] += e.bytes
                tiers = st.tiers.get(e.shard)
                if tiers is not None:
                    tiers[0] = e.tier
            acc[_FETCH_S] += e.fetch_s
            acc[_STALL_S] += e.stall_s
            acc[_OVERHEAD_S] += e.overhead_s
            return False
        if kind is ev.IoBatch:
            for item in e.items():
                self._on_io(st, item)
            return False
        if kind is ev.IoDone:
            self._on_io(st, e)
            return False
        if kind is ev.ShardTransfer:
            acc = st.acc_of(e.shard)
            t = _TIER_INDEX.get(e.tier)
            if t is not None:
                acc[(_READ0 if e.op == "read" else _WRITE0) + t] += e.bytes
            acc[_STALL_S] += e.stall_s
            return False
        if kind is ev.OptimizerShardDone:
            acc = st.acc_of(e.shard)
            acc[_OPT] += 1
            t = _TIER_INDEX.get(e.tier)
            if t is not None:
                acc[_READ0 + t] += e.read_bytes
                acc[_WRITE0 + t] += e.write_bytes
            acc[_OPTIM_S] += e.read_s + e.update_s + e.write_s
            acc[_UPDATE_S] += e.update_s
            tiers = st.tiers.get(e.shard)
            if tiers is not None:
                tiers[1] = e.tier
            return False
        if kind is ev.StepFinished:
            self._on_step(st, e)
            return False
        if kind is ev.RunStarted:
            if st is not None and not st.finished:
                self._finish(st, "crashed", time.time())
            st = self._state = _RunState(e)
            with self._drop_lock:
                st.dropped_base = Counter(self._dropped)
            self._starts.append(st)
            self._n_pending += 1
            return True
        if kind is ev.ShardMigrated:
            self._add("migrations", st, {
                "step": e.step, "plan_version": st.plan_version, "state": e.state, "src_tier": e.src_tier,
                "dst_tier": e.dst_tier, "bytes": int(e.bytes), "seconds": float(e.seconds),
            }, e.shard)
            which = 0 if e.state == "param" else 1
            if int(e.step) <= (st.last_step or 0):
                tiers = st.tiers.get(e.shard)  # after the step's row: from now on
                if tiers is not None:
                    tiers[which] = e.dst_tier
            else:
                st.moved_after_step.append((e.shard, which, e.dst_tier, int(e.step)))
            return False
        if kind is ev.RunFinished:
            status = e.status if e.status in ("finished", "crashed") else "crashed"
            self._finish(st, status, e.finished_at)
            return True
        if kind is _Command:
            return self._on_command(st, e)
        if kind is _Span:
            if st is not None and not st.finished:
                st.span = max(1, int(e.steps))
            return False
        self._drop(f"unknown:{kind.__name__}")
        return False

    def _on_io(self, st: _RunState, e: ev.IoDone) -> None:
        """One I/O request: into the run's totals and, within ``io_samples_per_step`` a step
        (reservoir sampling), the step's ``io_samples`` rows."""
        st.io_seen += 1
        cap = self.io_samples_per_step
        row = {
            "op": e.op, "tier": e.tier, "what": e.what, "bytes": int(e.bytes), "seconds": float(e.seconds),
            "o_direct": bool(e.o_direct), "block_size": e.block_size, "queue_depth": e.queue_depth,
            "thread_count": e.thread_count, "concurrency": float(e.concurrency), "_shard": e.shard,
        }
        tot = st.io_totals.get((e.tier, e.op))
        if tot is None:
            tot = st.io_totals[(e.tier, e.op)] = [0, 0.0]
        tot[0] += int(e.bytes)
        tot[1] += float(e.seconds)
        st.io_totals_changed = True
        if len(st.io_buf) < cap:
            st.io_buf.append(row)
        else:
            st.io_subsampled += 1
            j = self._rng.randrange(st.io_seen)
            if j < cap:
                st.io_buf[j] = row

    def _add(self, table: str, st: _RunState | None, row: dict, shard: str | None = None) -> None:
        self._rows[table].append((st, row, shard))
        self._n_pending += 1

    def _on_step(self, st: _RunState, e: ev.StepFinished) -> None:
        row = {
            "step": int(e.step), "recorded_at": time.time(), "micro_batches": int(e.micro_batches),
            "wall_s": float(e.wall_s), "forward_s": float(e.forward_s), "backward_s": float(e.backward_s),
            "optimizer_s": float(e.optimizer_s), "stall_s": float(e.stall_s), "migration_s": float(e.migration_s),
            "loss": None if e.loss is None else float(e.loss),
            "dram_bytes": int(e.dram_bytes), "pinned_bytes": int(e.pinned_bytes), "gpu_bytes": int(e.gpu_bytes),
            "rss_bytes": int(e.rss_bytes), "plan_version": int(e.plan_version),
        }
        for t in schema.TIERS:
            row[f"read_{t}_bytes"] = int(e.read_bytes.get(t, 0))
            row[f"written_{t}_bytes"] = int(e.written_bytes.get(t, 0))
        self._add("steps", st, row)
        st.last_step = int(e.step)
        st.plan_version = max(st.plan_version, int(e.plan_version))
        self._take_io(st, int(e.step))
        span, st.span = st.span, 1
        if span > 1:  # a sampled step stands for the steps since the last one: its counts x span
            for a in st.cur.values():
                for i in range(_ACC_LEN):
                    a[i] *= span
        if st.window_count == 0:
            st.window_first = int(e.step) - span + 1
            st.window = st.cur
        else:
            window = st.window
            for name, a in st.cur.items():
                w = window.get(name)
                if w is None:
                    window[name] = a
                else:
                    for i in range(_ACC_LEN):
                        w[i] += a[i]
        st.cur = {}
        st.window_count += span
        if st.window_count >= self.window_steps:
            self._close_window(st)
        if st.moved_after_step:  # the step's accesses ran on the old tiers; the next steps run on these
            later = []
            for shard, which, tier, step in st.moved_after_step:
                if step > int(e.step):
                    later.append((shard, which, tier, step))
                elif (tiers := st.tiers.get(shard)) is not None:
                    tiers[which] = tier
            st.moved_after_step = later

    def _take_io(self, st: _RunState, step: int) -> None:
        for row in st.io_buf:
            shard = row.pop("_shard")
            row["step"] = step
            self._add("io_samples", st, row, shard)
        st.io_buf = []
        st.io_seen = 0

    def _close_window(self, st: _RunState) -> None:
        if st.window_count == 0:
            return
        first, count = st.window_first, st.window_count
        for name, a in st.window.items():
            if name not in st.known:
                self._drop("unknown_shard")
                continue
            row = {
                "step": first, "window_steps": count,
                "forward_accesses": a[_FWD], "backward_accesses": a[_BWD],
                "recompute_accesses": a[_REC], "optimizer_accesses": a[_OPT],
                "fetch_s": a[_FETCH_S], "stall_s": a[_STALL_S], "optimizer_s": a[_OPTIM_S],
                "fetch_overhead_s": a[_OVERHEAD_S], "update_s": a[_UPDATE_S],
                "param_tier": st.tiers[name][0], "optim_tier": st.tiers[name][1],
            }
            for i, t in enumerate(schema.TIERS):
                row[f"read_{t}_bytes"] = a[_READ0 + i]
                row[f"written_{t}_bytes"] = a[_WRITE0 + i]
            self._add("shard_steps", st, row, name)
        st.window = {}
        st.window_first = None
        st.window_count = 0

    def _finish(self, st: _RunState, status: str, finished_at: float) -> None:
        self._close_window(st)  # a partial window: window_steps says how many steps it holds
        if st.cur:  # accesses after the last step belong to no step
            st.unattributed += sum(a[_FWD] + a[_BWD] + a[_REC] + a[_OPT] for a in st.cur.values())
            st.cur = {}
        if st.io_buf:
            self._take_io(st, st.next_step)
        st.finished = True
        st.update.update(status=status, finished_at=finished_at)
        self._touch(st)

    def _finish_all(self) -> None:
        st = self._state
        if st is not None and not st.finished:
            self._finish(st, "crashed", time.time())

    def _touch(self, st: _RunState) -> None:
        self._states_to_update[id(st)] = st
        self._n_pending += 1

    def _on_command(self, st: _RunState | None, c: _Command) -> bool:
        if c.kind == "plan":
            plan, rows = c.payload
            self._plans.append((st, plan, rows))
            self._n_pending += 1
            if plan["adopted"] and st is not None:
                st.plan_version = max(st.plan_version, plan["version"])
        elif c.kind == "trial":
            self._add("tuning_trials", st, c.payload)
        elif c.kind == "calibration":
            for row in c.payload:
                self._add("calibrations", None, row)
        elif c.kind == "bandwidths":
            if st is None:
                self._drop("no_run:record_bandwidths")
            else:
                st.bandwidths_given.update(c.payload)
                st.io_totals_changed = True
                self._touch(st)
        return False

    # -- writing -----------------------------------------------------------------------------
    def _write(self) -> bool:
        """Write everything pending in one transaction; False (and keep it) when that fails."""
        now = time.time()
        st_now = self._state
        started: list[_RunState] = []
        try:
            with self._engine.begin() as conn:
                for st in self._starts:
                    self._insert_run(conn, st, now)
                    started.append(st)
                for table, items in self._rows.items():
                    if not items:
                        continue
                    rows = []
                    for st, row, shard in items:
                        if st is not None:
                            if st.run_id is None:
                                continue  # its run could not be inserted; cannot happen after a commit
                            row["run_id"] = st.run_id
                        if table in ("shard_steps", "migrations"):
                            sid = st.shard_ids.get(shard)
                            if sid is None:
                                self._drop(f"unknown_shard:{table}")
                                continue
                            row["shard_id"] = sid
                        elif table == "io_samples":
                            row["shard_id"] = st.shard_ids.get(shard)
                        elif table == "tuning_trials" and st is None:
                            row["run_id"] = None
                        rows.append(row)
                    if rows:
                        conn.execute(getattr(schema, table).insert(), rows)
                        self.rows_written += len(rows)
                for st, plan, assignments in self._plans:
                    if st is None or st.run_id is None:
                        self._drop("no_run:record_plan")
                        continue
                    plan_id = conn.execute(schema.plans.insert().values(run_id=st.run_id, **plan)).inserted_primary_key[0]
                    arows = []
                    for shard, ptier, otier, score in assignments:
                        sid = st.shard_ids.get(shard)
                        if sid is None:
                            self._drop("unknown_shard:plan_assignments")
                            continue
                        arows.append({"plan_id": plan_id, "shard_id": sid, "param_tier": ptier, "optim_tier": otier,
                                      "score": None if score is None else float(score)})
                    if arows:
                        conn.execute(schema.plan_assignments.insert(), arows)
                    self.rows_written += 1 + len(arows)
                updates = dict(self._states_to_update)
                if st_now is not None and st_now.run_id is not None and not st_now.finished:
                    updates[id(st_now)] = st_now
                for st in updates.values():
                    if st.run_id is None:
                        continue
                    values = dict(st.update)
                    if st.io_totals_changed:
                        values["bandwidths"] = st.bandwidths()
                    values["last_heartbeat"] = now
                    values["dropped_events"] = self._dropped_for(st)
                    conn.execute(schema.runs.update().where(schema.runs.c.id == st.run_id).values(**values))
        except Exception as e:
            for st in started:  # rolled back: insert them again next time
                st.run_id = None
                st.shard_ids = {}
            self._fail_streak += 1
            self.last_error = f"{type(e).__name__}: {_one_line(e)}"
            backoff = min(30.0, 0.5 * 2 ** min(self._fail_streak, 6))
            self._retry_at = time.monotonic() + backoff
            if self._fail_streak == 1 or self._fail_streak % 10 == 0:
                log.warning("profiler: writing to %s failed (%s); retrying in %.1f s", self._shown, self.last_error, backoff)
            self._shed_if_too_much()
            return False
        # committed
        self._starts = []
        for items in self._rows.values():
            items.clear()
        self._plans = []
        for st in updates.values():
            st.update = {}
            st.io_totals_changed = False
        self._states_to_update = {}
        self._n_pending = 0
        self._fail_streak = 0
        self._retry_at = 0.0
        self._last_write = self._last_heartbeat = time.monotonic()
        if started:
            with self._run_cond:
                self._run_id = started[-1].run_id
                self._starts_written += len(started)
                self._run_cond.notify_all()
        return True

    def _shed_if_too_much(self, limit: int = 500_000) -> None:
        """While writes keep failing, keep memory bounded: drop the oldest detail rows."""
        for table, kind in (("io_samples", "IoDone"), ("shard_steps", "ShardFetched")):
            items = self._rows[table]
            if self._n_pending > limit and items:
                n = min(len(items), self._n_pending - limit)
                del items[:n]
                self._n_pending -= n
                self._drop(f"write_failed:{kind}", n)

    def _insert_run(self, conn: sa.Connection, st: _RunState, now: float) -> None:
        e = st.started
        hw = e.hardware or {}
        pid = os.getpid()
        run_id = conn.execute(
            schema.runs.insert().values(
                name=e.run_name, status="running", started_at=float(e.started_at), last_heartbeat=now,
                config=e.config, model=e.model, hardware=hw,
                bandwidths=hw.get("bandwidths") if isinstance(hw, Mapping) else None,
                swap_dir=e.swap_dir, o_direct=bool(e.o_direct), hostname=socket.gethostname(), pid=pid,
                pid_start_ticks=pid_start_ticks(pid), detail=self.detail, window_steps=self.window_steps,
                dropped_events={},
            )
        ).inserted_primary_key[0]
        if e.shards:
            conn.execute(
                schema.shards.insert(),
                [
                    {
                        "run_id": run_id, "shard_index": i, "name": s.name, "module": s.module, "kind": s.kind,
                        "numel": int(s.numel), "param_bytes": int(s.param_bytes), "optim_bytes": int(s.optim_bytes),
                        "grad_bytes": int(s.grad_bytes), "members": list(s.members), "param_tier": s.param_tier,
                        "optim_tier": s.optim_tier,
                    }
                    for i, s in enumerate(e.shards)
                ],
            )
        ids = conn.execute(sa.select(schema.shards.c.name, schema.shards.c.id).where(schema.shards.c.run_id == run_id))
        st.shard_ids = {name: sid for name, sid in ids}
        st.run_id = run_id

    def _dropped_for(self, st: _RunState) -> dict[str, int]:
        with self._drop_lock:
            d = {k: v - st.dropped_base.get(k, 0) for k, v in self._dropped.items() if v - st.dropped_base.get(k, 0) > 0}
        if st.io_subsampled:
            d["IoDone:subsampled"] = st.io_subsampled
        if st.unattributed:
            d["unattributed"] = st.unattributed
        return d


def _one_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None)
    text = str(orig if orig is not None else e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _calibration_row(r: Mapping[str, Any]) -> dict:
    unknown = set(r) - set(_CALIBRATION_COLUMNS) - {"seconds"}
    if unknown:
        raise ProfileError(
            f"calibration row has unknown keys {sorted(unknown)}; allowed: {', '.join(_CALIBRATION_COLUMNS)} (and seconds)"
        )
    if "path" not in r or "op" not in r:
        raise ProfileError("a calibration row needs at least 'path' and 'op' (plus bytes/GBps and the I/O settings)")
    row = {c: r.get(c) for c in _CALIBRATION_COLUMNS}
    row["path"] = str(row["path"])
    if row["created_at"] is None:
        row["created_at"] = time.time()
    if row["GBps"] is None and r.get("seconds") and r.get("bytes"):
        row["GBps"] = float(r["bytes"]) / float(r["seconds"]) / 1e9
    return row


def record_calibration(url: str, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write bench-io results to the ``calibrations`` table of ``url`` now; returns the row count.

    Each row: ``path``, ``op`` ("read"/"write"), ``fstype``, ``block_size``, ``queue_depth``,
    ``thread_count``, ``bytes``, ``GBps`` (or ``seconds``, to compute it), ``raw_baseline_GBps``,
    ``source`` and optionally ``created_at`` (epoch seconds, default now).
    """
    prepared = [_calibration_row(r) for r in rows]
    upgrade(url)
    if not prepared:
        return 0
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(schema.calibrations.insert(), prepared)
    except sa.exc.DBAPIError as e:
        raise ProfileError(f"cannot write calibrations to {describe_url(url)}: {_one_line(e)}; check that it is writable") from None
    finally:
        engine.dispose()
    return len(prepared)
