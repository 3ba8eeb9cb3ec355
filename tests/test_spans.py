"""The engine's transfers show as named spans in the torch profiler while it records, and enter
no ``record_function`` when it does not (each costs 3-6 us; the engine enters hundreds a step)."""

from __future__ import annotations

import contextlib

import torch

import zinf
from zinf.spans import span

from conftest import placement_config
from test_equivalence import OPT, _gpt


def test_a_step_on_nvme_shows_its_passes_fetches_and_gradients(tmp_path):
    model, data = _gpt()
    config = dict(placement_config("nvme", tmp_path), optimizer=OPT)
    with zinf.initialize(model, config) as engine:
        x, y = data.get(0)
        engine.backward(engine(x, y))
        engine.step()  # (the first pass records the trace)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            x, y = data.get(1)
            engine.backward(engine(x, y))
            engine.step()
    # the training thread's and autograd's spans (the torch profiler records the threads it was
    # started on and autograd's; updates during backward and the store's requests run on workers)
    names = {e.name for e in prof.events()}
    assert {"zinf.forward", "zinf.backward", "zinf.optimizer", "zinf.fetch.nvme", "zinf.grad.offload"} <= names, \
        sorted(n for n in names if n.startswith("zinf"))


def test_no_span_is_entered_while_the_profiler_does_not_record():
    assert isinstance(span("zinf.x"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not isinstance(span("zinf.x"), contextlib.nullcontext)
