"""The per-disk count of requests in flight, and the concurrency each shard-file request records."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from zinf.storage.inflight import InFlight, for_path
from zinf.storage.nvme import NvmeStore


def test_alone_is_one_and_two_overlapping_halves_are_one_and_a_half():
    c = InFlight()
    t = c.enter()
    time.sleep(0.02)
    assert c.leave(t)[1] == pytest.approx(1.0, abs=1e-6)
    a = c.enter()
    time.sleep(0.05)
    b = c.enter()  # b runs wholly beside a: concurrency 2; a ran half of its time alone
    time.sleep(0.05)
    _, cb = c.leave(b)
    _, ca = c.leave(a)
    assert cb == pytest.approx(2.0, abs=0.05)
    assert ca == pytest.approx(1.5, abs=0.15)
    assert c.count == 0


def test_one_counter_per_disk(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert for_path(tmp_path / "a") is for_path(tmp_path / "b")  # same filesystem


def test_store_requests_report_the_others_in_flight(tmp_path):
    events = []
    lock = threading.Lock()

    def listen(*e):
        with lock:
            events.append(e)

    with NvmeStore(tmp_path, run_name="c", listener=listen, staging_bytes=1 << 16, thread_count=4) as store:
        tensors = {f"k{i}": torch.randn(1 << 18) for i in range(8)}  # 1 MiB each
        for k, t in tensors.items():
            store.write(k, t)  # one at a time
        alone = [c for op, _, _, _, c in events if op == "write"]
        events.clear()
        futures = [store.read_async(k) for k in tensors]  # four request threads at once
        for f in futures:
            f.result()
        together = [c for op, _, _, _, c in events if op == "read"]
    assert len(alone) == 8 and max(alone) < 1.05
    assert len(together) == 8 and max(together) > 1.5  # these shared the disk with others
    assert all(c <= 4.0 + 1e-6 for c in together)  # never more than the request threads
