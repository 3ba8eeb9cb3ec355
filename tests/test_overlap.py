"""Prefetch, the pipelined optimizer and updates during backward: still exact, and really used.

The equivalence suite (test_equivalence.py) runs with the defaults, where all of it is on. Here:
the same training with all of it off must match too; each mechanism must actually engage (a
test that passes with the mechanism silently off would prove nothing); and divergent routing
must neither deadlock nor overflow the prefetch window.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zinf
from zinf.errors import ModelError
from zinf.events import IoDone, ListRecorder

from conftest import placement_config
from test_equivalence import MODELS, OPT, train_plain, train_zinf

TOL = 1e-6


def _sync(config: dict) -> dict:
    """``config`` with prefetch, the optimizer pipeline and updates during backward off."""
    config = copy.deepcopy(config)
    zero = config["zero_optimization"]
    zero["stage3_prefetch_bucket_size"] = 0
    zero["offload_optimizer"].update(pipeline_read=False, pipeline_write=False)
    config["zinf"]["overlap_optimizer"] = False
    return config


@pytest.mark.parametrize("case", ["gpt_accum4_clip", "moe_idle"])
def test_everything_synchronous_still_matches_pytorch(case, tmp_path):
    make, gas, clip = MODELS[case]
    model, data = make()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, gas, clip)
    losses, params, _ = train_zinf(model, data, gas, clip, _sync(placement_config("nvme", tmp_path, model)))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    for name, ref_p in ref_params.items():
        assert (params[name] - ref_p).abs().max().item() <= TOL, name


def _train(model, data, config, steps=4, recorder=None):
    config = dict(config, optimizer=OPT)
    engine = zinf.initialize(model, config, recorder=recorder)
    for step in range(steps):
        x, y = data.get(step)
        engine.backward(engine(x, y))
        engine.step()
    return engine


def test_prefetch_serves_fetches_within_its_window(tmp_path):
    model, data = MODELS["gpt_tied"][0]()
    with _train(model, data, placement_config("nvme", tmp_path, model)) as engine:
        stats, window = engine._prefetcher.stats, engine.overlap.prefetch_bytes
        assert window > 0 and engine._prefetcher.trace, "prefetch must be on by default"
        # after the recording step, fetches come from prefetches, not from synchronous reads
        assert stats.hits > 0 and stats.hits >= 3 * stats.misses, stats
        assert 0 < stats.max_window_bytes <= window, (stats, window)


def test_divergent_moe_routing_neither_deadlocks_nor_overflows(tmp_path):
    """Learned routing sends tokens to different experts every step, so the trace of step 1 is
    wrong later: prefetches get dropped, reads happen on the spot, training still matches."""
    torch.manual_seed(0)
    from zinf.models import build_model
    from zinf.models.data import TokenBatches, markov_tokens

    model, cfg = build_model("moe", "tiny")  # learned router: expert choice changes with training
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=4), 4, cfg.block_size, seed=4)
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, 1, 0.0)
    config = placement_config("nvme", tmp_path, model)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 20_000  # a small window: it must fill
    losses, params, _ = train_zinf(model, data, 1, 0.0, config)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    for name, ref_p in ref_params.items():
        assert (params[name] - ref_p).abs().max().item() <= TOL, name

    model2, _ = build_model("moe", "tiny")
    with _train(model2, data, config, steps=6) as engine:
        stats = engine._prefetcher.stats
        assert stats.max_window_bytes <= engine.overlap.prefetch_bytes
        assert stats.issued > 0 and stats.hits > 0
        assert stats.dropped + stats.misses > 0, f"routing never diverged from the trace: {stats}"


def test_updates_during_backward_skip_the_gradient_files(tmp_path):
    """With clipping off, NVMe shards are updated as their gradients arrive: no gradient file is
    written. With the feature off, every NVMe shard's gradient goes to its file and back."""
    model, data = MODELS["gpt_tied"][0]()
    on, off = ListRecorder(), ListRecorder()
    config = placement_config("nvme", tmp_path, model)
    with _train(copy.deepcopy(model), data, config, recorder=on) as engine:
        assert engine.overlap.eager
    config["zinf"]["overlap_optimizer"] = False
    with _train(copy.deepcopy(model), data, config, recorder=off) as engine:
        assert not engine.overlap.eager
    grad_writes = lambda rec: sum(1 for e in rec.of(IoDone) if e.op == "write" and e.what == "grad")
    assert grad_writes(on) == 0
    assert grad_writes(off) > 0


@pytest.mark.parametrize("case", ["gpt_tied", "moe_idle"])
def test_updates_during_backward_read_one_group_ahead_in_this_passs_order(case, tmp_path):
    """With updates during backward and a read-ahead granted, the optimizer group of the next
    NVMe shard backward will update (this pass's forward order, reversed: a routed model's
    experts are the ones it routed to) is read while the current module's backward runs; training
    still matches plain PyTorch, and every group read ahead is used or given back (no shard holds
    a group read when a step ends). Without a read-ahead granted (pipeline_read off) nothing is
    read ahead."""
    make, gas, clip = MODELS[case]
    model, data = make()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, gas, clip)
    config = placement_config("nvme", tmp_path, model)
    losses, params, _ = train_zinf(copy.deepcopy(model), data, gas, clip, config)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    for name, ref_p in ref_params.items():
        assert (params[name] - ref_p).abs().max().item() <= TOL, name
    with _train(copy.deepcopy(model), data, config, steps=3) as engine:
        assert engine.overlap.eager and engine.overlap.read_ahead_bytes > 0
        ahead = engine.backward_reads_ahead
        assert ahead > 0
        for step in range(3, 6):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            assert engine.backward_reads_ahead > ahead  # every backward reads ahead
            ahead = engine.backward_reads_ahead
            engine.step()
            assert all(st.group_reads is None for st in engine.states)  # used or given back
    config["zero_optimization"]["offload_optimizer"]["pipeline_read"] = False
    with _train(copy.deepcopy(model), data, config, steps=2) as engine:
        assert engine.overlap.eager and engine.overlap.read_ahead_bytes == 0
        assert engine.backward_reads_ahead == 0


def test_a_group_read_ahead_for_a_module_whose_backward_never_comes_is_given_back(tmp_path):
    """A module that runs in forward but whose output the loss does not use gets no backward: the
    group read ahead for it is given back when backward ends (not left holding its buffers into
    the next step, nor served to a later update), and training still matches plain PyTorch."""
    from torch import nn

    class SideBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.unused, self.last = (nn.Linear(64, 64, bias=False) for _ in range(3))  # a shard each

        def forward(self, x, y):
            h = torch.tanh(self.first(x))
            self.unused(h)  # computed, never used: no gradient reaches it
            return nn.functional.mse_loss(self.last(h), y)

    torch.manual_seed(0)
    model = SideBranch()
    batches = [(torch.randn(4, 64), torch.randn(4, 64)) for _ in range(4)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=OPT["params"]["lr"], betas=OPT["params"]["betas"],
                                eps=OPT["params"]["eps"], weight_decay=OPT["params"]["weight_decay"])
    config = dict(placement_config("nvme", tmp_path, model), optimizer=OPT)
    with zinf.initialize(model, config) as engine:
        assert engine.overlap.eager and engine.overlap.read_ahead_bytes > 0
        for x, y in batches:
            engine.backward(engine(x, y))
            ids = {st.shard.index for st in engine._backward_queue}
            engine.step()
            assert all(st.group_reads is None for st in engine.states)  # given back
            ref_opt.zero_grad(set_to_none=True)
            ref(x, y).backward()
            ref_opt.step()
        assert engine.backward_reads_ahead > 0
        assert ids == set(), "the queue is cleared when backward ends"
        state = engine.state_dict()
        for name, q in ref.named_parameters():
            assert (state[name] - q.detach()).abs().max().item() <= TOL, name


def test_a_tight_budget_turns_overlap_off_not_training(tmp_path):
    model, data = MODELS["gpt_tied"][0]()
    config = placement_config("nvme", tmp_path, model)
    with zinf.initialize(copy.deepcopy(model), dict(config, optimizer=OPT)) as engine:
        minimum = engine.dram_need.total_bytes - engine.dram_need.overlap_bytes
    config["zinf"]["dram_budget"] = minimum
    with _train(copy.deepcopy(model), data, config) as engine:
        assert engine.overlap.total_bytes == 0
        assert engine.dram_need.total_bytes <= minimum
        assert engine.global_steps == 4


def test_without_overlap_the_training_threads_io_waits_are_stalls_and_fetch_overhead_is_not_the_read(tmp_path):
    """No overlap buffers (a tight budget): every param fetch reads on the spot and every gradient
    spill is a synchronous write. Both are time the training thread waits on the disk, so both
    are stall (the planner takes compute = phase time - stall); of a fetch's stall, the overhead
    recorded is what is not waiting for its read."""
    from zinf.events import ShardFetched, ShardTransfer, StepFinished

    model, data = MODELS["gpt_tied"][0]()
    config = placement_config("nvme", tmp_path, model)
    config["gradient_accumulation_steps"] = 2
    with zinf.initialize(copy.deepcopy(model), dict(config, optimizer=OPT)) as engine:
        minimum = engine.dram_need.total_bytes - engine.dram_need.overlap_bytes
    config["zinf"]["dram_budget"] = minimum
    rec = ListRecorder()
    with _train(copy.deepcopy(model), data, config, steps=6, recorder=rec) as engine:
        assert engine.overlap.total_bytes == 0 and not engine.overlap.eager
    spills = [e for e in rec.of(ShardTransfer) if e.what == "grad" and e.op == "write"]
    written_s = sum(e.seconds for e in rec.of(IoDone) if e.op == "write" and e.what == "grad")
    assert spills and written_s > 0
    # each synchronous write ran inside the wait recorded for it
    assert sum(e.stall_s for e in spills) >= 0.95 * written_s
    fetches = [e for e in rec.of(ShardFetched) if e.tier == "nvme" and e.bytes > 0]
    assert fetches and all(0.0 < e.overhead_s < e.stall_s for e in fetches)
    # the step's stall holds its fetches, read-backs and spills
    per_step = sum(e.stall_s for e in rec.of(StepFinished))
    assert per_step >= 0.95 * (sum(e.stall_s for e in fetches) + sum(e.stall_s for e in rec.of(ShardTransfer)))


def test_500_steps_of_divergent_moe_routing_finish_within_the_pools(tmp_path):
    """Issue 3's soak: 500 steps of an MoE whose learned router changes its expert choice as it
    trains, so the recorded trace keeps going wrong. Training must finish (a hang fails the test
    after its timeout instead of blocking the suite), the prefetch window and the engine's buffer
    pool must stay inside what the DRAM accounting granted them, and the loss must still fall."""
    import threading

    from zinf.models import build_model
    from zinf.models.data import TokenBatches, markov_tokens

    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", n_embd=32, n_head=2, n_experts=4, block_size=16)
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=5), 2, cfg.block_size, seed=5)
    config = placement_config("nvme", tmp_path, model)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 20_000  # a window that must fill
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    result: dict = {}

    def train() -> None:
        try:
            with zinf.initialize(model, config) as engine:
                losses = []
                for step in range(500):
                    x, y = data.get(step)
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                result.update(engine=engine, losses=losses, stats=engine._prefetcher.stats,
                              peak=engine._buffers.peak_in_use_bytes)
        except BaseException as e:  # reported by the main thread
            result["error"] = e

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(timeout=240)
    assert not worker.is_alive(), "500 steps did not finish within 240 s: a hang in prefetch or the optimizer pipeline"
    if "error" in result:
        raise result["error"]
    engine, stats = result["engine"], result["stats"]
    assert engine.global_steps == 500
    assert stats.dropped + stats.misses > 0, f"routing never diverged from the trace: {stats}"
    assert stats.hits > 0 and stats.max_window_bytes <= engine.overlap.prefetch_bytes, stats
    granted = engine.dram_need.working_bytes + engine.dram_need.overlap_bytes
    assert 0 < result["peak"] <= granted, (result["peak"], engine.dram_need)
    first, last = result["losses"][:50], result["losses"][-50:]
    assert sum(last) / 50 < sum(first) / 50, "the loss did not fall over 500 steps"


def test_two_engines_side_by_side_drained_between_blocks_both_match_pytorch(tmp_path):
    """``engine.drain()`` between blocks of steps (how benchmarks/planner_policies.py runs the
    policies side by side) leaves nothing in flight and changes no number; mid-step it refuses;
    the step after it, and only that one, says so in ``last_step["after_drain"]``."""
    make, gas, clip = MODELS["gpt_accum4_clip"]
    model, data = make()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, gas, clip, steps=6)
    engines = []
    for name in ("a", "b"):  # both on NVMe: prefetch and write-behind are in use
        config = placement_config("nvme", tmp_path / name, model)
        config = dict(config, optimizer=OPT, gradient_accumulation_steps=gas, gradient_clipping=clip,
                      train_micro_batch_size_per_gpu=4)
        engines.append(zinf.initialize(copy.deepcopy(model), config))
    losses = {id(e): [] for e in engines}
    try:
        for block in range(0, 6, 2):  # steps 0-1, 2-3, 4-5 of each engine in turn
            for engine in engines:
                for step in range(block, block + 2):
                    for k in range(gas):
                        loss = engine(*data.get(step * gas + k))
                        losses[id(engine)].append(loss.item())
                        engine.backward(loss)
                        if step == block and k == 0:
                            with pytest.raises(ModelError, match="between optimizer steps"):
                                engine.drain()
                        engine.step()
                    assert engine.last_step["after_drain"] is (block > 0 and step == block), (block, step)
                engine.drain()
                assert engine._writes.in_flight_bytes == 0 and not engine._writes._futures
        assert engines[0].overlap.prefetch_bytes > 0 and engines[0].overlap.write_bytes > 0, "overlap must be on"
        for engine in engines:
            assert len(losses[id(engine)]) == len(ref_losses)
            assert max(abs(a - b) for a, b in zip(losses[id(engine)], ref_losses)) <= TOL
            params = engine.state_dict()
            for name, ref_p in ref_params.items():
                assert (params[name] - ref_p).abs().max().item() <= TOL, name
    finally:
        for engine in engines:
            engine.close()


def test_routed_experts_the_model_announces_are_read_ahead_instead_of_missed(tmp_path):
    """The MoE layer calls ``zinf.will_use`` with the experts its router picked. Under skewed
    routing most of them are seldom used and never read ahead along the trace: with the hint
    their reads start at routing time (hits), without it (``zinf.prefetch_hints: false``) each
    is a miss. Training matches plain PyTorch either way."""
    from zinf.models import build_model
    from zinf.models.data import TokenBatches, markov_tokens

    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="zipf", n_experts=16)
    # one sequence of 16 tokens a step over 16 experts: most experts run in few steps
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=5), 1, 16, seed=5)
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, 1, 0.0)
    stats = {}
    for hints in (True, False):
        config = placement_config("nvme", tmp_path / str(hints), model)
        config["zinf"]["prefetch_hints"] = hints
        losses, params, pf = train_zinf(copy.deepcopy(model), data, 1, 0.0, config,
                                        collect=lambda e: (e.state_dict(), e.prefetch_stats))
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, hints
        for name, ref_p in ref_params.items():
            assert (params[name] - ref_p).abs().max().item() <= TOL, (hints, name)
        stats[hints] = pf
    on, off = stats[True], stats[False]
    assert off.hinted == 0 and off.misses > 0, off
    assert on.hinted > 0, on
    assert on.misses < off.misses / 2, (on, off)


def test_will_use_outside_an_engine_and_after_close_does_nothing(tmp_path):
    """No engine: nothing happens. An open engine gets its own modules' announcements and no other
    model's; once closed it gets none. A second engine on a model an open one wraps is refused
    with one line (it would re-home parameters the first engine freed: a segfault)."""
    from zinf import hints
    from zinf.models import build_model

    model, _ = build_model("moe", "tiny", router="zipf", n_experts=4)
    other, _ = build_model("moe", "tiny", router="zipf", n_experts=4)
    probe = model.blocks[0].moe.experts[0]
    zinf.will_use(model.modules())  # no engine wraps it: nothing happens
    assert probe not in hints._owners
    engine = zinf.initialize(model, dict(placement_config("nvme", tmp_path, model), optimizer=OPT))
    assert hints._owners[probe]() is engine
    assert other.blocks[0].moe.experts[0] not in hints._owners
    with pytest.raises(ModelError, match="already wrapped by an open zinf engine; close that engine first"):
        zinf.initialize(model, dict(placement_config("nvme", tmp_path / "again", model), optimizer=OPT))
    engine.close()
    assert probe not in hints._owners
    zinf.will_use(model.modules())  # closed: announced to no one
