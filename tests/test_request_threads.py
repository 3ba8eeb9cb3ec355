"""The store's request threads run what someone waits for first (zinf.storage.requests), and
the store never lets an urgent read overtake the write it must follow."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from zinf.storage.nvme import NvmeStore
from zinf.storage.requests import RequestThreads


def _blocked(requests: RequestThreads, n: int) -> threading.Event:
    """Occupy ``n`` threads until the returned event is set (each has started when this returns)."""
    release, started = threading.Event(), threading.Barrier(n + 1)

    def hold() -> None:
        started.wait()
        release.wait()

    for _ in range(n):
        requests.submit(hold)
    started.wait(timeout=10)
    return release


def test_urgent_requests_start_before_the_queued_ones_and_the_rest_keep_their_order():
    requests = RequestThreads(1)
    order: list[str] = []
    release = _blocked(requests, 1)
    futures = [requests.submit(order.append, name, urgent=name.startswith("u")) for name in ("a", "b", "u1", "c", "u2")]
    release.set()
    for f in futures:
        f.result(timeout=10)
    requests.shutdown()
    assert order == ["u1", "u2", "a", "b", "c"]


def test_a_promoted_request_runs_once_before_the_rest_and_a_started_one_cannot_be_promoted():
    requests = RequestThreads(1)
    order: list[str] = []
    release = _blocked(requests, 1)
    a, b, c = (requests.submit(order.append, name) for name in "abc")
    assert requests.promote(c) and requests.promote(b)
    release.set()
    for f in (a, b, c):
        f.result(timeout=10)
    assert order == ["c", "b", "a"]  # each once: the other queue entry of a promoted one is skipped
    assert not requests.promote(c)  # done
    assert not requests.promote(__import__("concurrent.futures").futures.Future())  # not one of its own
    requests.shutdown()


def test_shutdown_runs_everything_asked_for_and_errors_reach_the_future():
    requests = RequestThreads(2)
    release = _blocked(requests, 2)
    done: list[int] = []
    futures = [requests.submit(done.append, i) for i in range(20)]
    bad = requests.submit(lambda: 1 / 0)
    release.set()
    requests.shutdown(wait=True)
    assert sorted(done) == list(range(20)) and all(f.done() for f in futures)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    with pytest.raises(RuntimeError, match="after shutdown"):
        requests.submit(done.append, 0)


def test_an_urgent_read_never_overtakes_a_write_of_its_key(tmp_path):
    """Both threads held, two writes queued, then urgent reads of the same two keys. Were the
    reads run first, each would hold a thread waiting for a write no thread is left to run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # O_DIRECT refused on some filesystems: not the point here
        store = NvmeStore(tmp_path, thread_count=2)
    try:
        old = {k: torch.full((4096,), 1.0) for k in ("k1", "k2")}
        for k, t in old.items():
            store.write(k, t)
        release = _blocked(store._requests, 2)
        new = {k: torch.full((4096,), 2.0 + i) for i, k in enumerate(old)}
        writes = [store.write_async(k, t) for k, t in new.items()]
        reads = {k: store.read_async(k, urgent=True) for k in new}
        assert not any(store.hurry(f) for f in reads.values())  # a write of the key is in flight
        release.set()
        for f in writes:
            f.result(timeout=20)
        for k, f in reads.items():
            assert torch.equal(f.result(timeout=20), new[k])  # the read followed its write
        # with nothing in flight for the key, a queued read can be hurried
        release = _blocked(store._requests, 2)
        queued = [store.read_async(k) for k in new]
        assert store.hurry(queued[1])
        release.set()
        assert torch.equal(queued[1].result(timeout=20), new["k2"])
        queued[0].result(timeout=20)
    finally:
        store.close()
