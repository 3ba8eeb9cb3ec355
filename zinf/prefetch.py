"""Trace-driven prefetch: read parameter shards from NVMe before the module that needs them runs.

The first micro-batch records the *trace*: the order in which shards had to be fetched (forward,
then backward, recompute included). Every later fetch finds its place in the trace and asks for
the reads of the shards that come next, as far ahead as the byte window allows
(``stage3_prefetch_bucket_size``, capped by the param buffers and the DRAM budget). So while a
module computes, the shards of the next ones are already in flight.

Conditional compute (MoE routing, branches) makes the order diverge from the trace. That is
safe by construction:

* a shard that is needed but was not prefetched is read on the spot (a stall, recorded);
* a prefetched shard that the run skipped past is dropped: its read finishes into its buffer,
  which goes back to the pool, and its bytes leave the window, so the window never overflows;
* nothing ever waits for a read that was not asked for, so nothing can deadlock.

A shard in use (being fetched, materialised for a module, uploaded ahead) gets no read for its
next use until it is freed: it may well be kept for that use, and the read would be dropped unread.

A shard released while the trace says it is needed again soon (within
``stage3_max_reuse_distance`` elements of other fetches, DeepSpeed's knob of that name) is kept
materialised instead of freed and read again; kept shards share the window with the reads in
flight. That matters for chunks of small parameters, which many modules use one after another,
and for the last layers, whose backward follows their forward at once.

Routing also makes the forward half of one recorded pass a poor guess: it names the experts that
pass routed to. So the forward half grows into the union of the passes' forwards (a shard first
fetched in a later pass is placed after the fetch before it in that pass), and each of its shards
carries the rate at which passes used it (an EWMA over passes, halflife ``USE_HALFLIFE_PASSES``);
the prefetch along the recorded trace (both its halves: a backward fetches what its forward did)
reads ahead only shards used in at least ``MIN_USE_RATE`` of recent passes. Below that,
a read ahead is more often dropped unread than used, and its disk time delays the reads that are
used; such a shard is read when needed (a miss). A dense model uses every shard every pass: its use
rates stay 1 and nothing is skipped.

Backward needs what this pass's forward used, in reverse; under routing that is not what the
recorded trace says (it holds the experts of the pass it was recorded in). So when backward starts
(:meth:`Prefetcher.begin_backward`), the rest of the pass follows this pass's own forward fetches,
reversed, instead of the recorded trace; the next pass returns to the recorded one.

A model that knows which modules it runs next can say so (``zinf.will_use(modules)``; the MoE
layer does, with the experts its router just picked): :meth:`Prefetcher.hint` reads their shards
ahead at once, in the window's free room and before any read the trace only guesses, and such a
read stays in flight until its shard is used or the pass's forward ends, whatever the trace's
position (the trace does not know the order routed experts run in). Under skewed routing most
experts a pass uses are seldom-used ones, which the trace never reads ahead: without the hint each
is a miss the training thread waits for, one after another; with it their reads overlap each other
and the compute of the experts before them.

A pass never looks past its own end: the next pass may start after an optimizer step that
rewrites the parameters, and a read issued before that write would return the old values. The
engine starts the next pass (:meth:`Prefetcher.begin_pass`) when its data is final.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field


USE_HALFLIFE_PASSES = 4
"""Passes over which a forward shard's use rate halves its memory of older passes."""
MIN_USE_RATE = 0.5
"""A forward shard is prefetched when recent passes used it at least this often."""


@dataclass
class InFlight:
    """One prefetch read: its future, the trace position it was asked for, its bytes."""

    future: Future
    position: int
    nbytes: int
    issued_at_s: float
    done_at_s: list[float] = field(default_factory=list)  # set by a callback when it lands
    hinted: bool = False  # asked for by a hint: not dropped when the trace's position passes it


@dataclass
class PrefetchStats:
    """Counters since the engine started (also exposed to the profiler through events)."""

    issued: int = 0
    """Reads asked for ahead of need."""
    hits: int = 0
    """Fetches served by a prefetch (whether or not it had landed yet)."""
    misses: int = 0
    """Fetches of a shard nobody had prefetched (a divergence from the trace, or no window)."""
    dropped: int = 0
    """Prefetches the run skipped past (order diverged); their buffers went back to the pool."""
    kept: int = 0
    """Releases that kept the shard materialised because it was needed again soon."""
    max_window_bytes: int = 0
    """The most bytes in flight and kept at once (never above the window)."""
    hinted: int = 0
    """Reads asked for because the model announced the module (:meth:`Prefetcher.hint`), of the
    ``issued``."""


class Prefetcher:
    """Keeps reads in flight along the recorded trace, within ``window_bytes``.

    The engine supplies three callbacks: ``start_read(shard)`` starts the asynchronous read of a
    shard's parameters and returns its future; ``nbytes_of(shard)`` is the bytes it moves;
    ``discard(future)`` takes back the buffer of a read that will not be used. Shards are opaque
    hashable handles (the engine passes its shard indices).
    """

    def __init__(
        self,
        start_read: Callable[[int], Future],
        nbytes_of: Callable[[int], int],
        discard: Callable[[Future], None],
        window_bytes: int,
        reuse_distance_bytes: int = 0,
        needs_read: Callable[[int], bool] | None = None,
        busy: Callable[[int], bool] | None = None,
    ) -> None:
        self.start_read = start_read
        self.nbytes_of = nbytes_of
        self.discard = discard
        self.window_bytes = window_bytes
        self.reuse_distance_bytes = reuse_distance_bytes
        # Whether a shard of the trace is read at all (with CUDA the trace also holds shards homed
        # in DRAM, uploaded along it but never read from disk); None: every shard is.
        self.needs_read = needs_read
        # Whether a shard's param is materialised now (in use, held for the pass, uploaded
        # ahead): a read for its next use would only be dropped if it is then kept, so it is
        # issued once the shard is freed, at a later fetch; None: never.
        self.busy = busy
        self._claimed: set[int] = set()  # reads handed over by claim() before their shard's take
        self.recording = True
        self.trace: list[int] = []
        self._positions: dict[int, list[int]] = {}  # shard -> sorted positions in the trace
        self._bytes_before: list[int] = [0]  # bytes of the trace entries before each position
        self.pos = 0  # the trace position of the next expected fetch
        self.in_flight: dict[int, InFlight] = {}
        self.in_flight_bytes = 0
        self.kept: dict[int, int] = {}  # shard -> bytes, kept materialised after its release
        self.kept_bytes = 0
        self.stats = PrefetchStats()
        self._recorded: tuple[list[int], dict[int, list[int]], list[int]] | None = None  # the trace, kept
        self._forward_uses: list[int] | None = []  # this pass's forward fetches; None once backward began
        self._forward_len: int | None = None  # entries of the recorded trace that are forward fetches
        self.use_rate: dict[int, float] = {}  # forward shard -> EWMA over passes of "this pass used it"
        self._walk: list[int] | None = None  # see _walk_positions; None: to work out again
        self._hints: list[int] = []  # hinted shards not read yet (no room in the window then), in order

    @property
    def enabled(self) -> bool:
        return self.window_bytes > 0

    # ------------------------------------------------------------------ trace
    def end_recording(self) -> None:
        """Stop recording (after the first micro-batch); the trace is used from now on."""
        if not self.recording:
            return
        self.recording = False
        self._index_trace(self.trace)
        self._recorded = (self.trace, self._positions, self._bytes_before)
        if self._forward_len is not None:
            self.use_rate = {shard: 1.0 for shard in self.trace[: self._forward_len]}
        self._walk = None

    def _learn_forward(self, uses: list[int]) -> None:
        """After a pass's forward (``uses``: its fetches in order): update each forward shard's
        use rate, and add the shards it fetched first to the recorded forward, each after the
        fetch before it in this pass."""
        if self._forward_len is None or self._recorded is None:
            return
        a = 1 - 0.5 ** (1 / USE_HALFLIFE_PASSES)
        used = set(uses)
        for shard, rate in self.use_rate.items():
            self.use_rate[shard] = rate + a * ((shard in used) - rate)
        self._walk = None  # (which shards are read ahead may have changed)
        new = [s for s in dict.fromkeys(uses) if s not in self.use_rate]
        if not new:
            return
        recorded = self._recorded[0]
        forward, backward = recorded[: self._forward_len], recorded[self._forward_len:]
        for shard in new:
            k = uses.index(shard)
            before = next((u for u in reversed(uses[:k]) if u in self.use_rate), None)
            forward.insert(forward.index(before) + 1 if before is not None else 0, shard)
            self.use_rate[shard] = a  # used once, in this pass
        self._forward_len = len(forward)
        self._index_trace(forward + backward)
        self._recorded = (self.trace, self._positions, self._bytes_before)

    def _index_trace(self, trace: list[int]) -> None:
        """Make ``trace`` the one followed: each shard's positions and the bytes before each."""
        self.trace, self._positions, self._bytes_before, self._walk = trace, {}, [0], None
        for i, shard in enumerate(trace):
            self._positions.setdefault(shard, []).append(i)
            self._bytes_before.append(self._bytes_before[-1] + self.nbytes_of(shard))

    def _locate(self, shard: int) -> None:
        """Move ``pos`` past the next occurrence of ``shard`` at or after it (if any)."""
        positions = self._positions.get(shard)
        if not positions:
            return  # never seen in the trace: keep going from where we were
        k = bisect.bisect_left(positions, self.pos)
        if k < len(positions):
            self.pos = positions[k] + 1
        # else: it appears only earlier in the trace (a repeat); keep the position

    # ------------------------------------------------------------------ fetches
    def begin_pass(self) -> None:
        """A new pass (micro-batch) starts at the top of the trace; data is final from here."""
        self.cancel()
        if self._recorded is not None and self.trace is not self._recorded[0]:
            self.trace, self._positions, self._bytes_before = self._recorded  # back from a backward's own
            self._walk = None
        self._forward_uses = []
        self._hints = []
        self.pos = 0
        self._issue()

    def begin_backward(self) -> None:
        """Backward starts: follow this pass's forward fetches in reverse (each shard at its last
        forward use) for the rest of the pass. Reads in flight for shards it does not name are
        dropped; the others keep going, at their new place. A pass with activation recompute must
        not call this: its backward also fetches for the recomputed forward."""
        uses, self._forward_uses = self._forward_uses, None
        self._hints = []  # (announced for this forward: backward follows the forward's own fetches)
        if self.recording:
            self._forward_len = len(self.trace)
            return
        if not self.enabled or uses is None:
            return
        self._learn_forward(uses)
        seen: set[int] = set()
        tail = [s for s in reversed(uses) if not (s in seen or seen.add(s))]
        self._index_trace(tail)
        self.pos = 0
        for shard in [s for s in self.in_flight if s not in self._positions]:
            self._drop(shard)
        for shard, entry in self.in_flight.items():
            entry.position = self._positions[shard][0]
            entry.hinted = False  # placed on backward's own trace now
        self._issue()

    def hint(self, shards: list[int]) -> None:
        """The model will use ``shards`` next in this pass's forward, in this order (the experts a
        router just picked): read them ahead now, before the reads the trace only guesses, as far
        as the window has room; the rest as room frees up. A shard in flight, kept, in use, or
        not read from disk is skipped."""
        if self.recording or not self.enabled or self._forward_uses is None:
            return
        pending = set(self._hints)
        self._hints += [s for s in dict.fromkeys(shards) if s not in pending]
        self._issue()

    def take(self, shard: int) -> InFlight | None:
        """``shard`` is needed now: its prefetch (to wait on) or None (read it yourself). Also
        advances along the trace and keeps the window full."""
        if self.recording:
            self.trace.append(shard)
            return None
        if self._forward_uses is not None:
            self._forward_uses.append(shard)
        entry = self.in_flight.pop(shard, None)
        if entry is not None:
            self.in_flight_bytes -= entry.nbytes
            self.stats.hits += 1
        elif shard in self._claimed:  # its read was claimed ahead of this use: a hit
            self._claimed.discard(shard)
            self.stats.hits += 1
        elif self.enabled and (self.needs_read is None or self.needs_read(shard)):
            self.stats.misses += 1
        self._locate(shard)
        self._drop_passed()
        self._issue(taking=shard)
        return entry

    def claim(self, shard: int) -> InFlight | None:
        """Hand over ``shard``'s read (landed or not) ahead of its use: it leaves the window (the
        engine has uploaded its data to the GPU); its :meth:`take` later moves along the trace and
        counts as a hit. None when no read of it is in flight."""
        entry = self.in_flight.pop(shard, None)
        if entry is not None:
            self.in_flight_bytes -= entry.nbytes
            self._claimed.add(shard)
            self._issue()
        return entry

    def keep(self, shard: int) -> bool:
        """``shard`` is being released: whether to keep it materialised, because the trace needs
        it again within the reuse distance and the window has room (then it counts in it)."""
        if self.recording or not self.enabled or self.reuse_distance_bytes <= 0:
            return False
        positions = self._positions.get(shard, ())
        k = bisect.bisect_left(positions, self.pos)
        if k == len(positions):
            return False  # not needed again in this pass
        distance = self._bytes_before[positions[k]] - self._bytes_before[self.pos]
        nbytes = self.nbytes_of(shard)
        if distance > self.reuse_distance_bytes or nbytes > self.window_bytes:
            return False
        if self._window_used() + nbytes > self.window_bytes:
            return False
        self.kept[shard] = nbytes
        self.kept_bytes += nbytes
        self.stats.kept += 1
        self._note_window()
        return True

    def reuse(self, shard: int) -> None:
        """A kept shard is acquired again: it leaves the window; move along the trace."""
        self.kept_bytes -= self.kept.pop(shard)
        if self._forward_uses is not None:
            self._forward_uses.append(shard)
        self._locate(shard)
        self._drop_passed()
        self._issue()

    def pop_kept(self) -> list[int]:
        """Forget every kept shard (the caller frees them): at the end of a pass, and before
        the parameters change."""
        shards = list(self.kept)
        self.kept.clear()
        self.kept_bytes = 0
        return shards

    def likely(self, shard: int) -> bool:
        """Whether to fetch ``shard`` ahead of need along the trace followed now: always in a
        backward's own trace; along the recorded one (both halves: a backward fetches what its
        forward did), when recent forwards used it at least ``MIN_USE_RATE`` of the time."""
        rates = self._learnt_rates()
        return rates is None or rates.get(shard, 1.0) >= MIN_USE_RATE

    def _learnt_rates(self) -> dict[int, float] | None:
        """The use rates that apply to the trace followed now: None in a backward's own trace."""
        return self.use_rate if self._recorded is not None and self.trace is self._recorded[0] else None

    def _walk_positions(self) -> list[int]:
        """The positions of the trace followed now whose shard is read ahead (:meth:`likely`), in
        order: the issuer walks these only. Worked out when the trace or the use rates change (a
        few times a pass), not at every fetch: on the MoE most of the recorded forward is experts
        passes seldom use, and the walk went through them to the trace's end at every fetch."""
        if self._walk is None:
            self._walk = [j for j, shard in enumerate(self.trace) if self.likely(shard)]
        return self._walk

    def _window_used(self) -> int:
        return self.in_flight_bytes + self.kept_bytes

    def _note_window(self) -> None:
        self.stats.max_window_bytes = max(self.stats.max_window_bytes, self._window_used())

    def cancel(self) -> None:
        """Drop every prefetch in flight (e.g. before an optimizer step rewrites the shards)."""
        for entry in self.in_flight.values():
            self.discard(entry.future)
            self.stats.dropped += 1
        self.in_flight.clear()
        self.in_flight_bytes = 0
        self._claimed.clear()
        self._hints = []

    def _drop_passed(self) -> None:
        for shard in [s for s, e in self.in_flight.items() if e.position < self.pos - 1 and not e.hinted]:
            self._drop(shard)

    def _issue_hinted(self, taking: int | None) -> bool:
        """Start the reads of the hinted shards that fit the window, in their order; False when
        one did not fit (the trace's guesses wait for it)."""
        needs_read, busy = self.needs_read, self.busy
        while self._hints:
            shard = self._hints[0]
            if (shard == taking or shard in self.in_flight or shard in self.kept or shard in self._claimed
                    or (needs_read is not None and not needs_read(shard)) or (busy is not None and busy(shard))):
                self._hints.pop(0)
                continue
            nbytes = self.nbytes_of(shard)
            if self._window_used() + nbytes > self.window_bytes:
                return False
            self._hints.pop(0)
            positions = self._positions.get(shard, ())
            k = bisect.bisect_left(positions, self.pos)
            self._start(shard, positions[k] if k < len(positions) else len(self.trace), nbytes, hinted=True)
        return True

    def _start(self, shard: int, position: int, nbytes: int, hinted: bool = False) -> None:
        entry = InFlight(self.start_read(shard), position, nbytes, time.perf_counter(), hinted=hinted)
        entry.future.add_done_callback(lambda f, e=entry: e.done_at_s.append(time.perf_counter()))
        self.in_flight[shard] = entry
        self.in_flight_bytes += nbytes
        self.stats.issued += 1
        self.stats.hinted += hinted
        self._note_window()

    def _drop(self, shard: int) -> None:
        """Give up ``shard``'s read in flight: it leaves the window, its buffer goes back."""
        entry = self.in_flight.pop(shard)
        self.in_flight_bytes -= entry.nbytes
        self.discard(entry.future)
        self.stats.dropped += 1

    def _issue(self, taking: int | None = None) -> None:
        """Start the reads along the trace that fit the window. ``taking``: the shard being
        fetched now, about to be in use (a read for its next use waits until it is freed)."""
        if self.recording or not self.enabled:
            return
        if self._hints and not self._issue_hinted(taking):
            return  # the window is full: what the model announced goes first as room frees up
        ahead_bytes = 0  # bytes of the trace ahead of pos covered so far, in flight or not
        # Runs at every fetch, along the trace ahead: the per-shard tests are kept cheap (locals,
        # the trace's own byte counts), the engine's callbacks asked last.
        trace, sizes, needs_read, busy = self.trace, self._bytes_before, self.needs_read, self.busy
        in_flight, kept, claimed = self.in_flight, self.kept, self._claimed
        walk = self._walk_positions()  # the positions of shards read ahead (likely())
        for k in range(bisect.bisect_left(walk, self.pos), len(walk)):
            j = walk[k]
            shard = trace[j]
            if shard == taking:
                continue
            nbytes = sizes[j + 1] - sizes[j]
            if shard in in_flight or shard in kept or shard in claimed:
                ahead_bytes += nbytes
                continue
            if (needs_read is not None and not needs_read(shard)) or (busy is not None and busy(shard)):
                continue
            if self._window_used() + nbytes > self.window_bytes or ahead_bytes + nbytes > 2 * self.window_bytes:
                return
            self._start(shard, j, nbytes)
            ahead_bytes += nbytes
