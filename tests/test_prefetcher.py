"""The prefetcher on its own (zinf.prefetch): reads along the trace within the window, the shards
it must not read (``needs_read``: with CUDA the trace also holds DRAM-homed shards) and reads
handed over early (``claim``: the engine uploaded the shard to the GPU before its use)."""

from __future__ import annotations

from concurrent.futures import Future

from zinf.prefetch import Prefetcher


def _reader() -> tuple:
    """A ``start_read`` that records the shards asked for and returns a landed read; and that record."""
    started: list[int] = []

    def start(shard: int) -> Future:
        started.append(shard)
        f = Future()
        f.set_result(shard)
        return f

    return start, started


def _prefetcher(window: int, needs_read=None):
    start, started = _reader()
    discarded: list[Future] = []
    pf = Prefetcher(start, lambda shard: 10, discarded.append, window_bytes=window, needs_read=needs_read)
    for shard in range(6):  # the first pass records the trace
        pf.take(shard)
    pf.end_recording()
    return pf, started, discarded


def test_reads_only_the_shards_that_need_a_read():
    pf, started, _ = _prefetcher(window=30, needs_read=lambda shard: shard % 2 == 0)
    pf.begin_pass()
    assert started == [0, 2, 4], "DRAM-homed shards (odd) are never read, and take no window"
    for shard in range(6):
        pf.take(shard)
    assert pf.stats.misses == 0 and pf.stats.hits == 3


def test_claimed_read_frees_the_window_and_counts_as_a_hit():
    pf, started, discarded = _prefetcher(window=20)
    pf.begin_pass()
    assert started == [0, 1]  # two of 10 bytes fit
    entry = pf.claim(1)
    assert entry is not None and entry.future.result() == 1
    assert 1 not in pf.in_flight and started == [0, 1, 2], "the claimed bytes leave the window: the next read starts"
    assert pf.take(0) is not None
    assert pf.take(1) is None, "a claimed read is not handed out twice"
    assert pf.stats.hits == 2 and pf.stats.misses == 0
    assert started.count(1) == 1, "a claimed shard is not read again"
    assert pf.claim(5) is None  # nothing in flight for it


def test_cancel_forgets_claims():
    pf, started, _ = _prefetcher(window=20)
    pf.begin_pass()
    pf.claim(0)
    pf.cancel()
    pf.begin_pass()
    assert started.count(0) == 2, "after a cancel (new pass) a claimed shard is read again"


def test_backward_follows_this_passs_forward_in_reverse_not_the_recorded_trace():
    """A routed pass: the recorded trace is forward 0 1 2, backward 2 1 0; this pass's forward
    runs 0 3 2 (expert 1 not routed to, expert 3 instead). Backward then needs 2 3 0."""
    start, started = _reader()
    discarded: list[Future] = []
    pf = Prefetcher(start, lambda shard: 10, discarded.append, window_bytes=20)
    for shard in (0, 1, 2, 2, 1, 0):
        pf.take(shard)
    pf.end_recording()
    pf.begin_pass()
    for shard in (0, 3, 2):
        pf.take(shard)
    assert pf.stats.misses == 1  # 3 was not foreseen
    pf.begin_backward()
    assert pf.trace == [2, 3, 0], "each shard once, at its last forward use, in reverse"
    assert set(pf.in_flight) <= {2, 3, 0}, "reads in flight for shards this backward needs not are dropped"
    misses = pf.stats.misses
    for shard in (2, 3, 0):
        assert pf.take(shard) is not None or shard in pf.kept
    assert pf.stats.misses == misses, "no backward fetch is a miss"
    assert 1 not in started[started.index(3):], "the un-routed expert is not read for backward"
    pf.begin_pass()
    assert pf.trace == [0, 1, 2, 2, 1, 0], "the next pass starts from the recorded trace again"


def test_the_forward_learns_which_shards_passes_use_and_reads_ahead_only_those_used_often():
    """Recorded forward 0 1 2; later passes route to 3 instead of 1. After a few passes the forward
    reads 3 ahead (placed after 0, where the passes fetched it) and no longer reads 1."""
    start, started = _reader()

    pf = Prefetcher(start, lambda shard: 10, lambda f: None, window_bytes=100)
    for shard in (0, 1, 2):
        pf.take(shard)
    pf.begin_backward()  # while recording: marks where the forward ends
    for shard in (2, 1, 0):
        pf.take(shard)
    pf.end_recording()

    def one_pass() -> tuple[list[int], int, int]:
        started.clear()
        misses, dropped = pf.stats.misses, pf.stats.dropped
        pf.begin_pass()
        for shard in (0, 3, 2):
            pf.take(shard)
        forward_reads = list(started)
        pf.begin_backward()
        for shard in (2, 3, 0):
            pf.take(shard)
        return forward_reads, pf.stats.misses - misses, pf.stats.dropped - dropped

    reads, misses, _ = one_pass()
    assert 1 in reads and misses == 1, "first: the recorded forward, and 3 is a miss"
    assert pf.trace[:4] != [0, 1, 2, 2] and pf._recorded[0][:4] == [0, 3, 1, 2], "3 joins the forward after 0"
    for _ in range(5):
        reads, misses, dropped = one_pass()
    assert 3 in reads and 1 not in reads, (reads, pf.use_rate)
    assert misses == 0 and dropped == 0
    assert pf.use_rate[1] < 0.5 <= pf.use_rate[3]


def test_a_dense_forward_reads_ahead_as_recorded():
    pf, started, _ = _prefetcher(window=30)
    pf.begin_pass()
    assert started == [0, 1, 2]


def test_a_shard_in_use_is_not_read_again_for_its_next_use_until_it_is_freed():
    """Forward 0 1 2, backward 2 1 0, a window for the whole pass: without the check every
    shard's backward read went out while its forward ran, and was dropped once the param was kept
    for that backward. Now a shard's next read waits until it is freed."""
    start, started = _reader()
    in_use: set[int] = set()

    pf = Prefetcher(start, lambda shard: 10, lambda f: None, window_bytes=1000, busy=in_use.__contains__)
    for shard in (0, 1, 2, 2, 1, 0):
        pf.take(shard)
    pf.end_recording()
    pf.begin_pass()
    assert started == [0, 1, 2], "each shard once: a read for its backward use would find it in flight"
    pf.take(0)
    in_use.add(0)
    assert started == [0, 1, 2], "0 is being fetched and then in use: its backward read waits"
    pf.take(1)
    in_use.add(1)
    assert 0 not in started[3:]
    in_use.discard(0)  # released and freed (not kept)
    pf.take(2)
    assert started.count(0) == 2, "once freed, its backward read goes out at the next fetch"
    assert 1 not in started[3:] and 2 not in started[3:]


def test_hinted_shards_are_read_first_within_the_window_and_survive_the_trace_moving_past_them():
    """Recorded forward 0..5 (each 10 bytes, window 30). A hint for 5 and 4 (the experts a router
    picked) reads them before the trace's guesses, in the hint's order, as room frees up; a hinted
    read is not dropped when the trace position passes its place, and its use is a hit."""
    pf, started, discarded = _prefetcher(window=30)
    pf.begin_pass()
    assert started == [0, 1, 2]
    started.clear()
    pf.hint([5, 4, 3])
    assert started == [], "the window is full: the hint waits for room, nothing is dropped for it"
    pf.take(0)  # frees 10 bytes: the first hinted shard goes before the trace's next guess (3)
    assert started == [5], started
    pf.take(1)
    assert started == [5, 4]
    pf.take(2)
    assert started == [5, 4, 3], "3 was hinted too: read once"
    assert pf.stats.hinted == 3
    pf.take(3)
    hits = pf.stats.hits
    pf.take(5)  # used before 4: the trace position jumps past 4's place ...
    entry = pf.take(4)  # ... and 4's hinted read is still there
    assert entry is not None and pf.stats.hits == hits + 2 and pf.stats.misses == 0
    assert not discarded


def test_hints_outside_a_forward_or_while_recording_read_nothing():
    start, started = _reader()
    pf = Prefetcher(start, lambda shard: 10, lambda f: None, window_bytes=100)
    pf.hint([3])  # recording the trace
    pf.take(0)
    pf.begin_backward()
    pf.take(0)
    pf.end_recording()
    pf.begin_pass()
    pf.take(0)
    pf.begin_backward()
    started.clear()
    pf.hint([1, 2])  # backward: it follows this pass's own forward
    assert started == [] and pf.stats.hinted == 0
