"""In-training I/O autotuning (planner/tuning.py) and the engine side it drives
(Engine.set_io_settings, NvmeStore.reconfigure, ChainedController): real NVMe files, a real SQLite
profile under tmp_path, fp32 on the CPU so training can be compared with plain PyTorch bit for bit."""

from __future__ import annotations

import copy
import logging
import statistics

import pytest
import torch

import zinf
from zinf.errors import BudgetError, ConfigError, ModelError
from zinf.placement import ChainedController, Move
from zinf.storage.nvme import NvmeStore

from conftest import gpt_batches, placement_config
from test_equivalence import train_plain

from profiler import queries
from planner import tuning
from planner.tuning import IoTuner, TuningSettings

OPT = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}}
KEYS = {"block_size", "queue_depth", "thread_count", "prefetch_bytes"}


def _gpt():
    torch.manual_seed(0)
    from zinf.models import build_model

    return build_model("gpt", "tiny")


def _config(tmp_path, *, autotune=None, detail="step", **zinf_extra) -> dict:
    c = placement_config("nvme", tmp_path)
    c["optimizer"] = OPT
    c["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 4}
    c["zinf"]["profiler"] = {"db": f"sqlite:///{tmp_path / 'profile.db'}", "detail": detail}
    if autotune is not None:
        c["zinf"]["autotune"] = {"enabled": True, **autotune}
    c["zinf"].update(zinf_extra)
    return c


def _train(engine, data, steps, losses=None):
    for i in range(steps):
        x, y = data.get(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if losses is not None:
            losses.append(loss.item())


def _backends(engine) -> set[tuple[int, int, int]]:
    """(block_size, queue_depth, thread_count) of every open store's live backend."""
    return {(s._backend.block_size, s._backend.queue_depth, s._backend.thread_count) for s in engine._stores.values()}


def _replay_choice(rows, min_gain):
    """Index of the trial the rule keeps: a trial replaces the best so far only when faster by
    more than min_gain (the rows are in the order the trials ran)."""
    best = 0
    for i in range(1, len(rows)):
        if rows[i] is not None and rows[i] < rows[best] * (1 - min_gain):
            best = i
    return best


# ---------------------------------------------------------------------------------- the tuner
def test_trials_are_measured_recorded_and_the_best_kept(tmp_path):
    model, cfg = _gpt()
    auto = {"trials": 4, "steps_per_trial": 2, "start_step": 1, "min_gain": 0.0}
    c = _config(tmp_path, autotune=auto, detail="shard")
    url = c["zinf"]["profiler"]["db"]
    with zinf.initialize(model, c) as engine:
        tuner = engine.controller
        assert isinstance(tuner, IoTuner)
        configured = dict(engine.io_settings)
        last = tuner.settings.last_step
        assert last == 1 + 5 * 4
        _train(engine, gpt_batches(cfg), last + 2)
        assert tuner.done and tuner.error is None
        kept = dict(engine.io_settings)
        run_id = engine.recorder.run_id
        assert _backends(engine) == {(kept["block_size"], kept["queue_depth"], kept["thread_count"])}
        engine.recorder.flush()
        trials = queries.tuning_trials(url, run_id)
        steps = queries.steps(url, run_id).set_index("step")
        io = queries.io_samples(url, run_id)

    assert len(trials) == len(tuner.trials) >= 3  # the configured one + at least two moves
    assert all(set(s) == KEYS for s in trials["setting"])
    assert trials["setting"].iloc[0] == configured
    assert len({tuple(sorted(s.items())) for s in trials["setting"]}) == len(trials)  # no setting twice
    # step_s is the median of the trial's recorded steps (wall minus migration seconds)
    for t, row in zip(tuner.trials, trials.itertuples()):
        want = list(range(t.applied_after + 2, t.applied_after + 4))
        assert t.steps == want and row.step == want[0]
        expected = statistics.median(float(steps.at[s, "wall_s"] - steps.at[s, "migration_s"]) for s in want)
        assert row.step_s == pytest.approx(expected, rel=1e-12) and row.step_s > 0
    assert trials["chosen"].sum() == 1
    chosen = trials.loc[trials["chosen"], "setting"].iloc[0]
    assert trials["chosen"].idxmax() == _replay_choice(list(trials["step_s"]), auto["min_gain"])
    assert chosen == kept
    # the I/O samples after tuning were taken with the kept setting
    after = io[io["step"] > last + 1]
    assert len(after) > 0
    assert set(zip(after["block_size"], after["queue_depth"], after["thread_count"])) == {
        (kept["block_size"], kept["queue_depth"], kept["thread_count"])}


def test_the_configured_setting_stays_unless_beaten_by_the_margin(tmp_path):
    model, cfg = _gpt()
    c = _config(tmp_path, autotune={"trials": 2, "steps_per_trial": 1, "start_step": 1, "min_gain": 0.99})
    with zinf.initialize(model, c) as engine:
        configured = dict(engine.io_settings)
        _train(engine, gpt_batches(cfg), engine.controller.settings.last_step + 1)
        assert engine.controller.done
        assert engine.io_settings == configured
        assert _backends(engine) == {(1 << 20, 8, 4)}
        assert engine._prefetch_override is None and engine._aio_override is None  # back to the config's rule
        engine.recorder.flush()
        trials = queries.tuning_trials(c["zinf"]["profiler"]["db"], engine.recorder.run_id)
    assert len(trials) == 3
    assert list(trials["chosen"]) == [True, False, False]


def test_autotune_trains_bit_identically_to_plain_pytorch(tmp_path):
    model, cfg = _gpt()
    plain = copy.deepcopy(model)
    c = _config(tmp_path, autotune={"trials": 4, "steps_per_trial": 1, "start_step": 1})
    c["train_micro_batch_size_per_gpu"] = 4
    data = gpt_batches(cfg, seed=1)
    losses: list[float] = []
    with zinf.initialize(model, c) as engine:
        steps = engine.controller.settings.last_step + 2
        _train(engine, data, steps, losses)
        tried = {tuple(sorted(t.setting.items())) for t in engine.controller.trials}
        final = engine.state_dict()

    ref, ref_params = train_plain(plain, data, 1, 0.0, steps)
    assert len(tried) >= 3  # the settings really changed during the run
    assert losses == ref
    for name, p in ref_params.items():
        assert torch.equal(final[name], p), name


def test_tuning_errors_stop_it_with_one_log_line_and_training_goes_on(tmp_path, monkeypatch, caplog):
    model, cfg = _gpt()
    c = _config(tmp_path, autotune={"trials": 2, "steps_per_trial": 1, "start_step": 1})

    def broken(*a, **k):
        raise RuntimeError("database on fire")

    monkeypatch.setattr(tuning.queries, "steps", broken)
    with caplog.at_level(logging.WARNING, logger="zinf"), zinf.initialize(model, c) as engine:
        configured = dict(engine.io_settings)
        _train(engine, gpt_batches(cfg), 8)
        assert engine.controller.done and "database on fire" in engine.controller.error
        assert engine.io_settings == configured
        assert engine.global_steps == 8
    lines = [r for r in caplog.records if "autotune" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage()


def test_nothing_on_nvme_means_nothing_to_tune(tmp_path):
    model, cfg = _gpt()
    c = _config(tmp_path, autotune={"trials": 2, "steps_per_trial": 1, "start_step": 1})
    c["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    with zinf.initialize(model, c) as engine:
        _train(engine, gpt_batches(cfg), 3)
        assert engine.controller.done and engine.controller.trials == []
        engine.recorder.flush()
        assert len(queries.tuning_trials(c["zinf"]["profiler"]["db"], engine.recorder.run_id)) == 0


def test_adaptive_plans_only_after_tuning(tmp_path):
    model, cfg = _gpt()
    c = _config(tmp_path, autotune={"trials": 1, "steps_per_trial": 1, "start_step": 1}, detail="shard",
                dram_budget="256MiB")
    c["zinf"]["placement"] = {"policy": "adaptive", "replan_every": 2}
    with zinf.initialize(model, c) as engine:
        chain = engine.controller
        assert isinstance(chain, ChainedController)
        tuner, adaptive = chain.controllers
        assert isinstance(tuner, IoTuner) and type(adaptive).__name__ == "AdaptiveController"
        assert adaptive.settings.first_plan_after == tuner.settings.last_step + adaptive.settings.window_steps
        assert adaptive.settings.replan_every == 2
        _train(engine, gpt_batches(cfg), tuner.settings.last_step + 1)
        assert tuner.done and adaptive.plans_made == 0
        engine.recorder.flush()
        assert len(queries.tuning_trials(c["zinf"]["profiler"]["db"], engine.recorder.run_id)) == 2


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize("autotune, needle", [
    ({"enabled": True, "trials": 0}, "zinf.autotune.trials"),
    ({"enabled": True, "steps_per_trial": 0}, "zinf.autotune.steps_per_trial"),
    ({"enabled": True, "start_step": 0}, "zinf.autotune.start_step"),
    ({"enabled": True, "min_gain": 1.5}, "zinf.autotune.min_gain"),
    ({"enabled": True, "trails": 3}, "trails"),
])
def test_bad_autotune_config_is_one_line_naming_the_key(autotune, needle):
    with pytest.raises(ConfigError) as e:
        zinf.load_config({"zinf": {"autotune": autotune}})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_autotune_needs_the_profiler(tmp_path):
    model, _ = _gpt()
    c = _config(tmp_path, autotune={})
    c["zinf"]["profiler"]["enabled"] = False
    with pytest.raises(ConfigError, match="zinf.autotune.enabled .*zinf.profiler.enabled is false") as e:
        zinf.initialize(model, c)
    assert "\n" not in str(e.value)

    class Quiet:
        enabled = False

        def emit(self, event): ...

        def close(self): ...

    c = _config(tmp_path, autotune={})
    with pytest.raises(ConfigError, match="database recorder"):
        zinf.initialize(model, c, recorder=Quiet())


def test_autotune_turns_the_profiler_on(tmp_path):
    model, _ = _gpt()
    c = _config(tmp_path, autotune={})
    assert "enabled" not in c["zinf"]["profiler"]
    with zinf.initialize(model, c) as engine:
        assert type(engine.recorder).__module__ == "profiler.recorder"


# ---------------------------------------------------------------------------------- engine side
def test_set_io_settings_changes_backends_window_and_resets(tmp_path):
    model, cfg = _gpt()
    c = _config(tmp_path)
    c["zinf"]["profiler"] = {"enabled": False}
    with zinf.initialize(model, c) as engine:
        data = gpt_batches(cfg)
        _train(engine, data, 2)
        configured = dict(engine.io_settings)
        largest = max(s.numel * 4 for s in engine.shards if engine.placement[s.name]["param"] == "nvme")
        got = engine.set_io_settings(thread_count=2, block_size=512 << 10, queue_depth=16, prefetch_bytes=largest)
        assert got == {"block_size": 512 << 10, "queue_depth": 16, "thread_count": 2, "prefetch_bytes": largest}
        assert engine.io_settings == got and _backends(engine) == {(512 << 10, 16, 2)}
        assert engine._prefetcher.window_bytes == largest
        from zinf.prefetch import PrefetchStats

        engine._prefetcher.stats = PrefetchStats()  # counters since start: look at these steps only
        _train(engine, data, 2)
        assert engine._prefetcher.stats.issued > 0
        assert engine._prefetcher.stats.max_window_bytes <= largest
        engine.set_io_settings(prefetch_bytes=0)
        assert engine.io_settings["prefetch_bytes"] == 0 and engine.io_settings["thread_count"] == 2
        # a migration re-sizes the overlap from the window asked for, not the config's
        name = next(iter(engine.placement))
        engine.migrate([Move(name, "optim", "cpu")])
        assert engine.io_settings["prefetch_bytes"] == 0
        assert engine.reset_io_settings() == configured
        assert _backends(engine) == {(1 << 20, 8, 4)}


def test_set_io_settings_refusals_are_one_line_and_change_nothing(tmp_path):
    model, cfg = _gpt()
    c = _config(tmp_path, dram_budget="64MiB")
    c["zinf"]["profiler"] = {"enabled": False}
    with zinf.initialize(model, c) as engine:
        data = gpt_batches(cfg)
        _train(engine, data, 1)
        before = dict(engine.io_settings)
        largest = max(s.numel * 4 for s in engine.shards if engine.placement[s.name]["param"] == "nvme")
        cases = [
            (dict(thread_count=0), ConfigError, "thread_count must be an int >= 1"),
            (dict(queue_depth=True), ConfigError, "queue_depth must be an int >= 1"),
            (dict(block_size=1000), ConfigError, "block_size must be a multiple of 4096"),
            (dict(block_size=2.5), ConfigError, "block_size must be an int"),
            (dict(prefetch_bytes=-1), ConfigError, "prefetch_bytes must be an int >= 0"),
            (dict(prefetch_bytes=largest - 1), ConfigError, "smaller than the largest parameter shard"),
            (dict(prefetch_bytes=64 << 20, thread_count=2), BudgetError, "does not fit zinf.dram_budget"),
        ]
        for kwargs, kind, needle in cases:
            with pytest.raises(kind) as e:
                engine.set_io_settings(**kwargs)
            assert needle in str(e.value) and "\n" not in str(e.value), kwargs
            assert engine.io_settings == before and _backends(engine) == {(1 << 20, 8, 4)}, kwargs
        x, y = data.get(1)
        loss = engine(x, y)  # a micro-batch is under way
        with pytest.raises(ModelError, match="engine.set_io_settings may only be called between optimizer steps") as e:
            engine.set_io_settings(thread_count=2)
        assert "\n" not in str(e.value)
        with pytest.raises(ModelError, match="engine.reset_io_settings may only"):
            engine.reset_io_settings()
        engine.backward(loss)
        engine.step()
        assert engine.set_io_settings(thread_count=2)["thread_count"] == 2


def test_store_reconfigure_keeps_requests_in_flight_and_data(tmp_path):
    with NvmeStore(tmp_path / "nvme", block_size=1 << 20, queue_depth=8, thread_count=4) as store:
        tensors = {f"k{i}": torch.randn(300_000 + i) for i in range(6)}
        writes = [store.write_async(k, t) for k, t in tensors.items()]
        store.reconfigure(block_size=64 << 10, queue_depth=2, thread_count=1)  # writes still in flight
        assert all(w.done() and w.exception() is None for w in writes)
        assert (store.block_size, store.queue_depth, store.thread_count) == (64 << 10, 2, 1)
        assert (store._backend.block_size, store._backend.thread_count) == (64 << 10, 1)
        reads = {k: store.read_async(k) for k in tensors}
        store.reconfigure(thread_count=3)
        for k, t in tensors.items():
            assert torch.equal(reads[k].result(), t)
            assert torch.equal(store.read(k), t)
        for bad in (dict(block_size=1000), dict(thread_count=0), dict(queue_depth=True)):
            with pytest.raises(ValueError):
                store.reconfigure(**bad)
        assert store.thread_count == 3


def test_chained_controller_concatenates_and_isolates_failures(caplog):
    a, b = Move("x", "param", "cpu"), Move("y", "optim", "nvme")

    class Gives:
        def __init__(self, moves):
            self.moves, self.calls = moves, 0

        def after_step(self, engine):
            self.calls += 1
            return self.moves

    class Fails:
        def after_step(self, engine):
            raise RuntimeError("boom")

    first, last = Gives([a]), Gives(b)
    chain = ChainedController(first, Fails(), Gives(None), last)
    with caplog.at_level(logging.WARNING, logger="zinf"):
        assert chain.after_step(None) == [a, b]
        assert chain.after_step(None) == [a, b]
    assert first.calls == last.calls == 2
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1  # once per message
    with pytest.raises(ConfigError):
        ChainedController(object())


def test_tuning_settings_from_config():
    cfg = zinf.load_config({"zinf": {"autotune": {"enabled": True, "trials": 3, "steps_per_trial": 2, "start_step": 5,
                                                  "min_gain": 0.1}}})
    s = TuningSettings.from_config(cfg.zinf.autotune)
    assert (s.trials, s.steps_per_trial, s.start_step, s.min_gain) == (3, 2, 5, 0.1)
    assert s.last_step == 5 + 4 * 4
