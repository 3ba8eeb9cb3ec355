"""zinf's own threads start no OpenMP team of their own (see zinf/threads.py).

A second team beside the training thread's made libgomp stop spin-waiting on the 2-core VM and
slowed a dense GPT step by 30% for the rest of the run. An OpenMP team shows up as native threads
that Python does not know of; these tests count them around work that used to start one: staged
asynchronous writes and reads on the NVMe store's request threads, and updates during backward
on the engine's optimizer worker, in training.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import zinf
from zinf.storage.nvme import NvmeStore
from zinf.threads import single_threaded_torch

from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

from conftest import placement_config
from test_equivalence import OPT


def native_threads() -> set[int]:
    """Thread ids of this process's OS threads that are not Python threads (OpenMP workers and
    the like)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def new_native_threads(before: set[int], timeout_s: float = 2.0) -> set[int]:
    """The native threads started since ``before`` (:func:`native_threads`) that are still
    there, given up to ``timeout_s`` to go: a Python thread that has just been joined may linger
    in /proc for a moment; an OpenMP team stays. (Threads that ended since do not count: a
    thread of an earlier test may end meanwhile.)"""
    deadline = time.monotonic() + timeout_s
    while (new := native_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new


@pytest.fixture
def two_torch_threads():
    """Intra-op parallelism on (a team would have workers), and the main thread's team started."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1)  # the training thread's own team exists from here on
    yield
    torch.set_num_threads(before)


def test_single_threaded_torch_limits_only_the_calling_thread(two_torch_threads):
    seen = {}

    def work():
        single_threaded_torch()
        seen["worker"] = torch.get_num_threads()
        torch.ones(1 << 22).add_(1)  # large enough to run in parallel where allowed

    t = threading.Thread(target=work)
    before = native_threads()
    t.start()
    t.join()
    assert seen["worker"] == 1
    assert torch.get_num_threads() == 2, "the calling thread's limit leaked to the main thread"
    assert not new_native_threads(before), "the worker started an OpenMP team"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_staged_async_io_starts_no_openmp_team(two_torch_threads, tmp_path):
    with NvmeStore(tmp_path, block_size=1 << 20, thread_count=2) as store:
        # views at an odd element offset are never 4096-aligned: O_DIRECT stages them
        # through a buffer, a copy_ of up to a block on the request thread
        base = torch.randn(4 * (1 << 20) + 1)
        tensors = [base[1 + i * (1 << 20) : 1 + (i + 1) * (1 << 20)] for i in range(4)]
        store.write_async("warm", tensors[0]).result()  # the request threads exist from here on
        before = native_threads()
        for f in [store.write_async(f"t{i}", t) for i, t in enumerate(tensors)]:
            f.result()
        outs = [base[1 + i * (1 << 20) : 1 + (i + 1) * (1 << 20)] for i in range(4)]
        for f in [store.read_async(f"t{i}", out) for i, out in enumerate(outs)]:
            f.result()
        assert not new_native_threads(before)


def test_training_with_every_overlap_starts_no_openmp_team(two_torch_threads, tmp_path):
    """Write-behind, read-ahead and updates during backward, on NVMe homes: a few steps of
    training add no native thread (the engine's own threads are Python threads)."""
    # weight matrices of 256 x 1024 elements: above torch's grain size, so an update or a
    # staged copy would run in parallel on a thread allowed to
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny", n_layer=1, n_embd=256)
    data = TokenBatches(markov_tokens(cfg.vocab_size, 5_000, seed=1), 2, cfg.block_size, seed=1)
    config = dict(placement_config("nvme", tmp_path, model), optimizer=OPT, gradient_clipping=0.0)
    before = native_threads()
    with zinf.initialize(model, config) as engine:
        overlap = engine.overlap
        assert overlap.eager and overlap.write_bytes > 0, "the overlap this test is about must be on"
        for step in range(3):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        assert not new_native_threads(before)
