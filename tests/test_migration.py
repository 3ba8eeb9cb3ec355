"""Migrations of shard homes between DRAM and NVMe between steps: exact, crash-safe, budgeted.

Training that migrates param and optimizer homes back and forth must still match plain PyTorch
exactly (fp32 on the CPU), whatever the placement it starts from; a move that fails halfway must
leave its shard whole in the old home; the byte and DRAM budgets, pins and the accumulation
boundary must be honoured; and a controller set on the engine is asked once per optimizer step.
All on real swap files (O_DIRECT where the filesystem allows it); the only fake is a store write
made to fail with ENOSPC.
"""

from __future__ import annotations

import copy
import errno
import logging

import pytest
import torch

import zinf
from zinf.errors import ConfigError, ModelError
from zinf.events import ListRecorder, ShardFetched, ShardMigrated, StepFinished
from zinf.placement import MigrationReport, Move, PlacementController
from zinf.storage.nvme import NvmeStore

from conftest import placement_config
from test_equivalence import MODELS, OPT, STEPS, _gpt, train_plain

TOL = 1e-6


def _other(tier: str) -> str:
    return "nvme" if tier == "cpu" else "cpu"


def _config(kind: str, tmp_path, model, gas: int = 1, clip: float = 0.0) -> dict:
    config = dict(placement_config(kind, tmp_path, model), optimizer=OPT, gradient_accumulation_steps=gas,
                  gradient_clipping=clip, train_micro_batch_size_per_gpu=4)
    config["zinf"]["nvme_path"] = str(tmp_path / "nvme")  # where a DRAM placement's first move to NVMe goes
    return config


def _train(engine, data, steps: int, gas: int = 1, first: int = 0, after_step=None) -> list[float]:
    """``steps`` optimizer steps on the batches train_plain uses; ``after_step(engine, step)``
    runs between steps (where migrations may happen). Returns every micro-batch's loss."""
    losses = []
    for step in range(first, first + steps):
        for k in range(gas):
            x, y = data.get(step * gas + k)
            loss = engine(x, y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        if after_step is not None:
            after_step(engine, step)
    return losses


def _assert_matches(losses, params, ref_losses, ref_params) -> None:
    assert len(losses) == len(ref_losses)
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= TOL, f"loss differs by {worst}"
    assert set(params) == set(ref_params)
    for name, ref_p in ref_params.items():
        diff = (params[name] - ref_p).abs().max().item()
        assert diff <= TOL, f"{name} differs by {diff}"


def _flips(engine, point: int) -> list[Move]:
    """Flip (cpu <-> nvme) the param home of every third shard and the optimizer home of every
    second one, another subset at each point: over a few points every combination of homes is
    passed through, and many shards move more than once."""
    moves = []
    for i, (name, homes) in enumerate(engine.placement.items()):
        if i % 3 == point % 3:
            moves.append(Move(name, "param", _other(homes["param"])))
        if i % 2 == point % 2 and homes["optim"] != "none":
            moves.append(Move(name, "optim", _other(homes["optim"])))
    return moves


class _Migrator:
    """Migrates with :func:`_flips` after the chosen steps, by direct ``engine.migrate`` calls
    between steps, and checks each report: everything done, the placement really changed."""

    def __init__(self, at_steps) -> None:
        self.at_steps = list(at_steps)
        self.moved: dict[tuple[str, str], list[str]] = {}  # (shard, state) -> tiers it went to

    def __call__(self, engine, step: int) -> None:
        if step not in self.at_steps:
            return
        moves = _flips(engine, self.at_steps.index(step))
        report = engine.migrate(moves)
        assert report.refused == [] and report.deferred == [], report
        assert report.done == moves and report.bytes_moved > 0
        for m in moves:
            assert engine.placement[m.shard][m.state] == m.dst
            self.moved.setdefault((m.shard, m.state), []).append(m.dst)


EQUIVALENCE_CASES = {
    # model case of test_equivalence, accumulation, clipping, starting placement
    "gpt_tied": ("gpt_tied", 1, 0.0, "max_in_cpu"),
    "gpt_accum2_clip": ("gpt_tied", 2, 0.05, "nvme"),
    "moe_idle": ("moe_idle", 1, 0.0, "dram"),  # no swap store at start: opened by the first move
    "frozen_block": ("frozen_block", 1, 0.0, "nvme"),  # frozen shards move their param home only
}


@pytest.mark.parametrize("case", list(EQUIVALENCE_CASES))
def test_training_with_migrations_matches_plain_pytorch(case, tmp_path):
    model_case, gas, clip, placement = EQUIVALENCE_CASES[case]
    model, data = MODELS[model_case][0]()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, gas, clip)
    migrator = _Migrator(at_steps=[1, 4, 7, 10, 13])
    with zinf.initialize(model, _config(placement, tmp_path, model, gas, clip)) as engine:
        losses = _train(engine, data, STEPS, gas, after_step=migrator)
        params = engine.state_dict()
        if model_case == "moe_idle":  # idle experts moved their (moment-less) optimizer homes too
            idle = [st for st in engine.states if ".experts.7." in st.name and st.name.startswith("blocks.0.")]
            assert idle and all(not st.has_moments and st.steps == [0] for st in idle)
            assert any((st.name, "optim") in migrator.moved for st in idle)
    _assert_matches(losses, params, ref_losses, ref_params)
    # the schedule really moved homes both ways, and some of them more than once
    went = [tier for tiers in migrator.moved.values() for tier in tiers]
    assert {"cpu", "nvme"} <= set(went)
    assert any(len(t) >= 2 for (_, state), t in migrator.moved.items() if state == "param")
    assert any(len(t) >= 2 for (_, state), t in migrator.moved.items() if state == "optim")


def test_bf16_migrations_change_not_a_bit(tmp_path):
    """bf16 working copies (separate param files and DRAM homes, no aliasing with the fp32
    master): a run with migrations is bit-identical to the same run without."""
    model, data = _gpt()
    config = dict(_config("max_in_cpu", tmp_path, model), bf16={"enabled": True})
    with zinf.initialize(copy.deepcopy(model), config) as engine:
        still_losses = _train(engine, data, 8)
        still = engine.state_dict()
    migrator = _Migrator(at_steps=[1, 3, 5])
    with zinf.initialize(copy.deepcopy(model), config) as engine:
        assert engine.dtype == torch.bfloat16
        losses = _train(engine, data, 8, after_step=migrator)
        got = engine.state_dict()
    assert losses == still_losses
    assert all(torch.equal(got[n], still[n]) for n in still)
    assert len(migrator.moved) > 10


def test_byte_budget_defers_the_rest_in_order(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("nvme", tmp_path, model)) as engine:
        _train(engine, data, 1)
        big = [st for st in engine.states if st.shard.numel >= 16384][:4]
        # fp32, both homes on NVMe: the param file is the master file, so a param move to DRAM
        # copies exactly the working copy (4 bytes an element)
        moves = [Move(st.name, "param", "cpu") for st in big]
        budget = 4 * (big[0].shard.numel + big[1].shard.numel)
        report = engine.migrate(moves, max_bytes=budget)
        assert report.done == moves[:2]
        assert report.deferred == moves[2:]  # the fourth would not fit either way: "the rest"
        assert report.refused == [] and report.bytes_moved == budget
        assert [engine.placement[m.shard]["param"] for m in moves] == ["cpu", "cpu", "nvme", "nvme"]
        # a no-op (already there) is not counted: with a zero budget it is neither done nor deferred
        again = engine.migrate(moves[:1], max_bytes=0)
        assert (again.done, again.deferred, again.refused, again.bytes_moved) == ([], [], [], 0)
        assert engine.last_migration is again
        assert engine.migrate(report.deferred).done == moves[2:]
        _train(engine, data, 2, first=1)


def test_dram_budget_refuses_a_move_that_would_not_fit(tmp_path):
    model, data = _gpt()
    config = _config("nvme", tmp_path, model)
    with zinf.initialize(copy.deepcopy(model), config) as probe:
        minimum = probe.dram_need.total_bytes - probe.dram_need.overlap_bytes
    config["zinf"]["dram_budget"] = minimum + 64 * 1024  # 64 KiB of room beyond the placement's need
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, 1, 0.0)
    with zinf.initialize(model, config) as engine:
        losses = _train(engine, data, 2)
        big = max(engine.states, key=lambda st: st.shard.numel)  # 64 Ki elements: 1 MiB of optimizer state
        small = min(engine.states, key=lambda st: st.shard.numel)
        report = engine.migrate([Move(big.name, "optim", "cpu"), Move(small.name, "param", "cpu")])
        assert [m for m, _ in report.refused] == [Move(big.name, "optim", "cpu")]
        assert "over the DRAM budget" in report.refused[0][1] and "zinf.dram_budget" in report.refused[0][1]
        assert report.done == [Move(small.name, "param", "cpu")]  # a small one still fits
        assert engine.placement[big.name] == {"param": "nvme", "optim": "nvme"}
        assert engine.dram_need.total_bytes - engine.dram_need.overlap_bytes <= config["zinf"]["dram_budget"]
        losses += _train(engine, data, STEPS - 2, first=2)
        params = engine.state_dict()
    _assert_matches(losses, params, ref_losses, ref_params)


def test_pinned_frozen_and_gpu_moves_are_refused(tmp_path):
    from zinf.models import freeze

    model, data = _gpt()
    freeze(model, "wpe.")
    config = _config("pins", tmp_path, model)  # offload_param pins: blocks[0] -> cpu, blocks[1-] -> nvme
    config["zero_optimization"]["offload_optimizer"]["module_parameters"] = {"blocks[3]": {"device": "nvme"}}
    with zinf.initialize(model, config) as engine:
        _train(engine, data, 1)
        before = engine.placement
        moves = [
            Move("blocks.0.attn.c_attn.weight", "param", "nvme"),
            Move("blocks.3.mlp.c_fc.weight", "optim", "cpu"),
            Move("wpe.weight", "optim", "cpu"),
            Move("wte.weight", "param", "gpu"),
            Move("wte.weight", "optim", "cpu"),  # not pinned: this one goes
        ]
        report = engine.migrate(moves)
        why = dict(report.refused)
        assert set(why) == set(moves[:4])
        assert "pinned by module_parameters 'blocks[0]'" in why[moves[0]] and "offload_param" in why[moves[0]]
        assert "pinned by module_parameters 'blocks[3]'" in why[moves[1]] and "offload_optimizer" in why[moves[1]]
        assert "frozen" in why[moves[2]]
        assert why[moves[3]] == "gpu-tier migrations are not supported yet"
        assert report.done == [moves[4]]
        assert {n: p for n, p in engine.placement.items() if n != "wte.weight"} == {
            n: p for n, p in before.items() if n != "wte.weight"}
        assert engine.placement["wte.weight"]["optim"] == "cpu"
        _train(engine, data, 1, first=1)


def test_migrate_only_between_optimizer_steps(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("nvme", tmp_path, model, gas=2)) as engine:
        name = engine.states[3].name
        move = [Move(name, "param", "cpu")]
        x, y = data.get(0)
        loss = engine(x, y)
        with pytest.raises(ModelError, match="only be called between optimizer steps"):
            engine.migrate(move)  # a forward whose backward has not run
        engine.backward(loss)
        with pytest.raises(ModelError, match="between optimizer steps"):
            engine.migrate(move)  # gradients pending, step() not called
        engine.step()
        with pytest.raises(ModelError, match="micro-batch 2 is under way"):
            engine.migrate(move)  # inside the accumulation window
        x, y = data.get(1)
        engine.backward(engine(x, y))
        engine.step()  # the window ends: now it may
        assert engine.migrate(move).done == move
        with torch.no_grad():
            engine(x, y)  # evaluation between steps does not open a window
        assert engine.migrate([Move(name, "param", "nvme")]).done


def test_bad_moves_raise_before_anything_moves(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("nvme", tmp_path, model)) as engine:
        _train(engine, data, 1)
        before = engine.placement
        good = Move(engine.states[3].name, "param", "cpu")
        with pytest.raises(ConfigError, match="unknown shard 'no.such.weight'.*engine.placement"):
            engine.migrate([good, Move("no.such.weight", "param", "cpu")])
        with pytest.raises(ConfigError, match="Move.state must be one of 'param', 'optim'"):
            Move(good.shard, "grad", "cpu")
        with pytest.raises(ConfigError, match="Move.dst must be one of 'cpu', 'nvme'"):
            Move(good.shard, "param", "disk")
        with pytest.raises(ConfigError, match="zinf.placement.Move"):
            engine.migrate([good, {"shard": good.shard}])
        with pytest.raises(ConfigError, match="max_bytes"):
            engine.migrate([good], max_bytes=-1)
        assert engine.placement == before
        assert engine.migrate([(good.shard, "param", "cpu")]).done == [good]  # 3-tuples are fine


def test_a_failed_write_leaves_the_shard_in_its_old_home(tmp_path, monkeypatch):
    """ENOSPC on the second file of an optimizer group going to NVMe: the first file is removed
    again, the shard keeps its DRAM home, training goes on exactly; the same move works later."""
    model, data = _gpt()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, 1, 0.0)
    with zinf.initialize(model, _config("dram", tmp_path, model)) as engine:
        losses = _train(engine, data, 3)
        st = next(s for s in engine.states if s.shard.numel == 65536)
        master_before = st.master.clone()
        moments_before = {k: v.clone() for k, v in st.moments.items()}
        real_write = NvmeStore.write
        calls = []

        def full_disk(store, key, tensor):
            calls.append(key)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(store, key, tensor)

        monkeypatch.setattr(NvmeStore, "write", full_disk)
        move = Move(st.name, "optim", "nvme")
        report = engine.migrate([move])
        monkeypatch.undo()
        assert report.done == [] and [m for m, _ in report.refused] == [move]
        assert "No space left on device" in report.refused[0][1] and "stays in its cpu home" in report.refused[0][1]
        assert calls[:2] == [st.key("master"), st.key("exp_avg")]
        assert engine.placement[st.name] == {"param": "cpu", "optim": "cpu"}
        assert torch.equal(st.master, master_before) and st.param_home is st.master
        assert all(torch.equal(st.moments[k], v) for k, v in moments_before.items())
        assert engine._stores["optim"].keys() == [], "the half-written group must be removed"
        losses += _train(engine, data, 3, first=3)
        assert engine.migrate([move]).done == [move]  # with room on the disk it goes
        assert set(engine._stores["optim"].keys()) == {st.key(n) for n in ("master", "exp_avg", "exp_avg_sq")}
        losses += _train(engine, data, STEPS - 6, first=6)
        params = engine.state_dict()
    _assert_matches(losses, params, ref_losses, ref_params)


def _swap_files(store) -> set[str]:
    """Names of the shard files in a store's run directory (hidden spares of retired versions
    left out: they hold no key and are overwritten by later writes)."""
    return {p.name for p in store.run_dir.iterdir() if p.name.endswith(".shard") and not p.name.startswith(".")}


def test_swap_files_follow_the_homes(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("max_in_cpu", tmp_path, model)) as engine:
        _train(engine, data, 1)
        store = engine._stores["optim"]
        out = next(st for st in engine.states if st.place.param == "nvme")  # both homes on NVMe
        into = next(st for st in engine.states if st.place.param == "cpu")  # param in DRAM
        out_files = {f"{out.key(n)}.shard" for n in ("master", "exp_avg", "exp_avg_sq")}
        assert out_files <= _swap_files(store)
        assert f"{into.key('param')}.shard" not in _swap_files(store)
        report = engine.migrate([Move(out.name, "param", "cpu"), Move(out.name, "optim", "cpu"),
                                 Move(into.name, "param", "nvme")])
        assert len(report.done) == 3
        files = _swap_files(store)
        assert not any(f.startswith(f"{out.shard.index:05d}.") for f in files), files
        assert f"{into.key('param')}.shard" not in files  # fp32, both homes on NVMe: the master file serves
        assert f"{into.key('master')}.shard" in files
        assert out.master is not None and out.param_home is out.master
        engine.migrate([Move(into.name, "optim", "cpu")])  # now the param needs a file of its own
        assert f"{into.key('param')}.shard" in _swap_files(store)
        assert f"{into.key('master')}.shard" not in _swap_files(store)
        _train(engine, data, 1, first=1)


def test_fetches_and_prefetches_use_the_new_homes(tmp_path):
    model, data = _gpt()
    rec = ListRecorder()
    with zinf.initialize(model, _config("max_in_cpu", tmp_path, model), recorder=rec) as engine:
        _train(engine, data, 2)
        to_dram = next(st for st in engine.states if st.place.param == "nvme")
        to_nvme = next(st for st in engine.states if st.place.param == "cpu" and st.shard.numel >= 16384)
        assert to_dram.shard.index in engine._prefetcher.trace
        assert to_nvme.shard.index not in engine._prefetcher.trace
        engine.migrate([Move(to_dram.name, "param", "cpu"), Move(to_nvme.name, "param", "nvme")])
        hits_before = engine._prefetcher.stats.hits
        start = len(rec.events)
        _train(engine, data, 3, first=2)
        fetched = [e for e in rec.events[start:] if isinstance(e, ShardFetched)]
        assert {e.tier for e in fetched if e.shard == to_dram.name} == {"cpu"}
        assert {e.tier for e in fetched if e.shard == to_nvme.name} == {"nvme"}
        assert any(e.bytes > 0 for e in fetched if e.shard == to_nvme.name)
        trace = engine._prefetcher.trace  # recorded again after the param moves
        assert to_nvme.shard.index in trace and to_dram.shard.index not in trace
        assert engine._prefetcher.stats.hits > hits_before


def test_a_dram_placement_gets_prefetch_once_params_move_to_nvme(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("dram", tmp_path, model)) as engine:
        _train(engine, data, 1)
        assert engine._stores == {} and engine.overlap.prefetch_bytes == 0
        moved = [st for st in engine.states if st.shard.numel >= 16384][:3]
        engine.migrate([Move(st.name, "param", "nvme") for st in moved])
        assert engine.overlap.prefetch_bytes > 0 and engine._stores["param"].root == tmp_path / "nvme"
        _train(engine, data, 3, first=1)
        assert {st.shard.index for st in moved} <= set(engine._prefetcher.trace)
        assert engine._prefetcher.stats.hits > 0


class _FlipController:
    """Flips the homes ``plan[step]`` names after that optimizer step, and re-issues whatever the
    engine deferred at the step before (as a real controller would)."""

    def __init__(self, plan: dict[int, list[tuple[str, str]]]) -> None:
        self.plan = plan
        self.calls: list[tuple[int, int]] = []  # (global_steps, micro_steps) at each call

    def after_step(self, engine):
        self.calls.append((engine.global_steps, engine.micro_steps))
        deferred = engine.last_migration.deferred if engine.last_migration else []
        flips = [Move(name, state, _other(engine.placement[name][state])) for name, state in self.plan.get(engine.global_steps, [])]
        return deferred + flips


def test_controller_is_asked_once_per_optimizer_step(tmp_path):
    model, data = _gpt()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, 2, 0.0)
    config = _config("max_in_cpu", tmp_path, model, gas=2)
    # 1.5 MiB a step: an optimizer group of 64 Ki elements is 768 KiB (master + 2 moments)
    config["zinf"]["placement"] = {"migration_bytes_per_step": "1.5MiB"}
    big = ["blocks.0.mlp.c_fc.weight", "blocks.1.mlp.c_fc.weight", "blocks.2.mlp.c_fc.weight"]
    plan = {2: [(n, "optim") for n in big], 5: [("wte.weight", "param"), ("blocks.3.mlp.c_fc.weight", "param")],
            9: [("wte.weight", "param")]}
    controller = _FlipController(plan)
    assert isinstance(controller, PlacementController)
    rec = ListRecorder()
    with zinf.initialize(model, config, recorder=rec, controller=controller) as engine:
        assert engine.controller is controller and engine.last_migration is None
        reports = {}

        def keep_report(engine, step):
            reports[engine.global_steps] = engine.last_migration

        losses = _train(engine, data, STEPS, gas=2, after_step=keep_report)
        params = engine.state_dict()
        placement = engine.placement
    _assert_matches(losses, params, ref_losses, ref_params)
    assert controller.calls == [(s, 2 * s) for s in range(1, STEPS + 1)]
    # step 2: the third group would pass 1.5 MiB: deferred, re-issued and done at step 3
    assert [m.shard for m in reports[2].done] == big[:2] and [m.shard for m in reports[2].deferred] == big[2:]
    assert reports[2].bytes_moved <= 1.5 * 2**20
    assert [m.shard for m in reports[3].done] == big[2:] and reports[3].deferred == []
    assert all(placement[n]["optim"] == "cpu" for n in big)
    assert placement["wte.weight"]["param"] == "cpu"  # flipped at step 5 and back at step 9
    assert placement["blocks.3.mlp.c_fc.weight"]["param"] == "cpu"
    assert all(isinstance(r, MigrationReport) for r in reports.values())
    migrated = rec.of(ShardMigrated)
    assert [(e.step, e.shard, e.state) for e in migrated] == [
        (s, m.shard, m.state) for s in sorted(reports) for m in reports[s].done]
    assert all(e.seconds > 0 for e in migrated)
    for s, report in reports.items():
        assert sum(e.bytes for e in migrated if e.step == s) == report.bytes_moved
    # wte's param leaving DRAM at step 5 copies nothing: both homes on NVMe in fp32 share the
    # master file; coming back at step 9 copies its working copy (4 bytes an element)
    wte = [e.bytes for e in migrated if e.shard == "wte.weight"]
    assert wte == [0, 4 * 32768]
    steps = {e.step: e for e in rec.of(StepFinished)}
    assert sorted(steps) == list(range(1, STEPS + 1))
    with_moves = {e.step for e in migrated}
    assert with_moves == {2, 3, 5, 9}
    assert all(steps[s].migration_s > 0 for s in with_moves)
    assert all(steps[s].migration_s == 0 for s in steps if s not in with_moves)
    assert all(steps[s].migration_s <= steps[s].wall_s for s in steps)


def test_a_failing_controller_does_not_stop_training(tmp_path, caplog):
    class Broken:
        def __init__(self):
            self.calls = 0

        def after_step(self, engine):
            self.calls += 1
            if self.calls % 2:
                raise RuntimeError("planner exploded")
            return [Move("no.such.shard", "param", "cpu")]

    model, data = _gpt()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, 1, 0.0)
    rec = ListRecorder()
    broken = Broken()
    with caplog.at_level(logging.WARNING, logger="zinf"):
        with zinf.initialize(model, _config("nvme", tmp_path, model), recorder=rec, controller=broken) as engine:
            losses = _train(engine, data, STEPS)
            params = engine.state_dict()
            assert engine.last_migration == MigrationReport()
    _assert_matches(losses, params, ref_losses, ref_params)
    assert broken.calls == STEPS
    assert len(rec.of(StepFinished)) == STEPS
    warned = [r.getMessage() for r in caplog.records if "placement controller" in r.getMessage()]
    assert len(warned) == 2, warned  # once per distinct message
    assert any("planner exploded" in w for w in warned) and any("no.such.shard" in w for w in warned)


def test_checkpoint_after_migrations_resumes_identically(tmp_path):
    model, data = _gpt()
    fresh_model, _ = _gpt()
    config = _config("max_in_cpu", tmp_path, model, clip=1.0)
    with zinf.initialize(model, config) as straight:
        _train(straight, data, 8, after_step=_Migrator(at_steps=[2, 5]))
        migrated_placement = straight.placement
        straight.save_checkpoint(tmp_path / "ckpt")
        expected_losses = _train(straight, data, 6, first=8)
        expected = straight.state_dict()
    with zinf.initialize(fresh_model, config) as resumed:  # the placement of the start, not the migrated one
        assert resumed.placement != migrated_placement
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.global_steps == 8
        losses = _train(resumed, data, 3, first=8)
        assert resumed.migrate(_flips(resumed, 0)).done  # and migrations after a load work too
        losses += _train(resumed, data, 3, first=11)
        got = resumed.state_dict()
    assert losses == expected_losses
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_migrations_show_in_the_torch_profiler(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("nvme", tmp_path, model)) as engine:
        _train(engine, data, 1)
        name = engine.states[3].name
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.migrate([Move(name, "param", "cpu"), Move(name, "optim", "cpu")])
        spans = {e.name for e in prof.events()}
        assert {"zinf.migrate.param.nvme_to_cpu", "zinf.migrate.optim.nvme_to_cpu"} <= spans


def test_dram_need_of_a_hypothetical_placement_moves_nothing(tmp_path):
    model, data = _gpt()
    with zinf.initialize(model, _config("nvme", tmp_path, model)) as engine:
        before = dict(engine.placement)
        now = engine.dram_need_of({})
        assert (now.param_homes_bytes, now.optim_homes_bytes, now.working_bytes) == (
            engine.dram_need.param_homes_bytes, engine.dram_need.optim_homes_bytes, engine.dram_need.working_bytes)
        all_cpu = engine.dram_need_of({name: {"param": "cpu", "optim": "cpu"} for name in engine.placement})
        assert all_cpu.optim_homes_bytes > 0 and all_cpu.staging_bytes == 0  # nothing left on NVMe
        params_cpu = engine.dram_need_of({name: {"param": "cpu"} for name in engine.placement})
        assert params_cpu.param_homes_bytes > 0 and params_cpu.working_bytes < now.working_bytes  # resident params
        assert engine.placement == before
