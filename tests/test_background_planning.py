"""Planning off the training thread: the engine's DRAM arithmetic asked without touching the
engine, the planning process, and plans made there against the same plans made inline."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import time

import pytest
import torch

import zinf
from zinf.placement import Move, ShardPlacement
from zinf.sizing import DramSizing, ShardSizes

import planner.background
import planner.controller as pc
from planner.background import PlanningProcess, PlanningProcessError
from planner.controller import AdaptiveController, ControllerSettings, EngineView, _plan_in_child
from planner.policy import PolicySettings
from profiler import queries

from test_controller import MiB, adaptive_config, skewed_moe
from test_equivalence import train_steps


# ------------------------------------------------------------------ sizing without side effects
def test_asking_what_a_placement_needs_changes_nothing_and_matches_moving_there(tmp_path):
    """``dram_need_of`` and ``overlap_of`` answer for another placement without touching the
    shards' places (a planner asks from another process while training runs), and say what the
    engine then has once it really moves there; a pickled :class:`EngineView` says the same."""
    model, _, data = skewed_moe()
    config = adaptive_config(tmp_path, 16 * MiB, policy="static")
    with zinf.initialize(model, config) as engine:
        x, y = data.get(0)
        engine.backward(engine(x, y))
        engine.step()
        before = copy.deepcopy(engine.placement)
        names = [n for n, t in before.items() if t["optim"] == "nvme"][:3]
        target = {n: {"param": "cpu", "optim": "cpu"} for n in names}
        need, overlap = engine.dram_need_of(target), engine.overlap_of(target)
        view = pickle.loads(pickle.dumps(EngineView.of(engine)))
        assert engine.placement == before, "asking moved nothing"
        assert (view.dram_need_of(target), view.overlap_of(target)) == (need, overlap)
        assert need.optim_homes_bytes > engine.dram_need.optim_homes_bytes  # three shards' homes more in DRAM
        engine.migrate([Move(n, s, "cpu") for n in names for s in ("param", "optim")])
        # (the engine's own need also counts the overlap buffers it granted)
        assert engine.dram_need == dataclasses.replace(need, overlap_bytes=overlap.total_bytes)
        assert engine.overlap == overlap


def test_an_fp32_shard_with_both_homes_in_dram_keeps_one_copy_on_either_device():
    """fp32, both homes in DRAM: the master is also the param home (on the CPU device the
    parameter itself, with a GPU the page-locked upload source), so the param home costs no
    bytes. Two copies stay where the two differ: bf16, an NVMe optimizer home, a param on the GPU."""
    sh = ShardSizes("w", param_bytes=4096, optim_bytes=3 * 4096, grad_bytes=4096, trainable=True, chunked=False)
    gpu = DramSizing(shards=(sh,), chains=(((0,), (0,)),), on_cpu=False, fp32=True, staging_bytes=0,
                     pipeline_write=True, pipeline_read=True, eager_wanted=True)
    cpu = dataclasses.replace(gpu, on_cpu=True)

    def param_bytes(sizing, param, optim):
        return sizing.need([ShardPlacement(param, optim)]).param_homes_bytes

    assert param_bytes(gpu, "cpu", "cpu") == param_bytes(cpu, "cpu", "cpu") == 0
    assert gpu.need([ShardPlacement("cpu", "cpu")]).optim_homes_bytes == 4 * 4096  # master, moments, gradient
    assert param_bytes(gpu, "cpu", "nvme") == 4096
    assert param_bytes(dataclasses.replace(gpu, fp32=False), "cpu", "cpu") == 4096
    assert param_bytes(gpu, "gpu", "cpu") == 0  # on the device: no DRAM at all
    frozen = dataclasses.replace(gpu, shards=(dataclasses.replace(sh, trainable=False, optim_bytes=0, grad_bytes=0),))
    assert param_bytes(frozen, "cpu", "cpu") == 4096  # no master to share


# ------------------------------------------------------------------ the planning process
def _raise(message: str) -> None:
    raise ValueError(message)


def test_the_planning_process_runs_on_idle_cpu():
    if not hasattr(os, "sched_getscheduler"):
        pytest.skip("SCHED_IDLE is Linux's")
    proc = PlanningProcess()
    try:
        proc.start()  # (set by the parent as it starts the child: its imports already run so)
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE, "it runs only on CPU nothing else wants"
    finally:
        proc.kill()  # (closing its pipe would wait for it to get CPU to exit)
        proc.stop()
    assert proc.pid is None


def test_the_planning_process_answers_reports_failures_and_restarts():
    proc = PlanningProcess(idle=False)
    try:
        child = proc.call(os.getpid)
        assert child != os.getpid() and proc.pid == child
        assert os.sched_getscheduler(child) == os.sched_getscheduler(0), "idle=False: this process's priority"
        assert proc.cpu_seconds() > 0, "it has run (its imports)"
        with pytest.raises(PlanningProcessError, match="ValueError: no plan today"):
            proc.call(_raise, "no plan today")
        assert proc.call(os.getpid) == child, "a failing request leaves the process running"
        proc.kill()
        with pytest.raises(PlanningProcessError, match="stopped"):
            proc.call(os.getpid)
        assert proc.cpu_seconds() is None, "no process, no CPU seconds"
        assert proc.call(os.getpid) not in (child, None), "the next request starts another process"
    finally:
        proc.stop()
    assert proc.pid is None


# ------------------------------------------------------------------ plans made elsewhere
@pytest.fixture
def planning_process(monkeypatch):
    """The controller's planning process, at this process's CPU priority: these tests check what
    it computes and when plans are taken up, and under SCHED_IDLE other work on the machine
    (another test run) leaves it no CPU at all (which test_a_starved_planning_process_... covers)."""
    proc = PlanningProcess(idle=False)
    monkeypatch.setattr(pc, "shared_process", lambda: proc)
    yield proc
    proc.stop()


class _Recorded:
    """Keeps the plans a controller records (the inline side of the comparison)."""

    def __init__(self, run_id: int) -> None:
        self.run_id, self.plans = run_id, []

    def flush(self) -> None:
        pass

    def record_plan(self, *args, **kwargs) -> None:
        self.plans.append(kwargs)

    def set_shard_detail_every(self, k: int) -> int:
        return k


def test_a_plan_made_in_the_planning_process_is_the_plan_made_inline(tmp_path, planning_process):
    """The same controller state and profile give the same plan in the planning process (from a
    pickled :class:`EngineView`) as on the training thread (from the engine itself)."""
    model, _, data = skewed_moe(skew=3.0)
    # (no prefetch window: every param read from NVMe is a stall a home in DRAM saves, so that the
    # first plan moves homes - with a window, the model may find every home best left behind it)
    config = adaptive_config(tmp_path, 8 * MiB, prefetch=False, replan_every=1000)  # the engine's controller never plans here
    with zinf.initialize(model, config) as engine:
        for step in range(8):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        engine.recorder.flush()
        run_id = engine.recorder.run_id
        settings = ControllerSettings(replan_every=4, policy=PolicySettings(margin=0, min_gain_fraction=0))
        fresh = AdaptiveController(config["zinf"]["profiler"]["db"], None, 8 * MiB, settings)
        fresh._step_now = step = engine.global_steps
        fresh._time_update_once(engine)  # as after_step does before handing a plan over
        state = fresh.__getstate__()

        inline = AdaptiveController.__new__(AdaptiveController)
        inline.__dict__.update(copy.deepcopy(state))
        inline.recorder = _Recorded(run_id)
        moves_inline = inline._plan_or_skip(engine, step, False, None)

        moves, after, calls, lines = planning_process.call(
            _plan_in_child, AdaptiveController, state, EngineView.of(engine), step, False, None, run_id)
    assert moves_inline, "the skewed MoE's first plan moves hot experts into DRAM"
    assert [(m.shard, m.state, m.dst) for m in moves] == [(m.shard, m.state, m.dst) for m in moves_inline]
    recorded = [kw for name, _, kw in calls if name == "record_plan"]
    assert len(recorded) == len(inline.recorder.plans) == 1
    # (with no shard wholly in DRAM yet, both read the optimizer update timed once beforehand)
    assert recorded[0]["adopted"] == inline.recorder.plans[0]["adopted"]
    for key in ("predicted_step_s", "predicted_gain_s"):
        assert recorded[0][key] == pytest.approx(inline.recorder.plans[0][key], rel=1e-9), key
    assert after["plans_made"] == inline.plans_made == 1 and after["_target"] == inline._target
    assert any("plan 1" in line for _, line in lines), lines


def test_plans_are_made_elsewhere_and_taken_up_within_the_lag(tmp_path, planning_process):
    """An adaptive run with ``plan_lag_steps`` 2: every plan is made in the planning process and
    taken up at most 2 steps after it was due; the log lines and plans it made are recorded by
    the training process; training matches the same run planned inline (lag 0) exactly."""
    steps = 16

    def run(lag: int):
        model, _, data = skewed_moe(skew=3.0)
        # (a plan must be adopted: no prefetch window and no band for untried engine modes, as in
        # test_controller's tests that need one)
        config = adaptive_config(tmp_path / f"lag{lag}", 8 * MiB, prefetch=False, trial_band=0, plan_lag_steps=lag)
        with zinf.initialize(model, config) as engine:
            losses = train_steps(engine, data, steps)
            engine.recorder.flush()
            plans = queries.plans(config["zinf"]["profiler"]["db"], engine.recorder.run_id)
            return losses, engine.controller, plans, engine.plan_version

    losses, controller, plans, version = run(2)
    assert controller.plan_lags, "plans were made in the planning process"
    for due, taken, _ in controller.plan_lags:
        assert due < taken <= due + 2
    assert len(plans) == controller.plans_made >= 2 and version == int(plans["adopted"].sum()) >= 1
    assert planning_process.pid not in (None, os.getpid())
    inline_losses, inline_controller, inline_plans, _ = run(0)
    assert not inline_controller.plan_lags and len(inline_plans) >= 2
    assert max(abs(a - b) for a, b in zip(losses, inline_losses)) <= 1e-6, "placement never changes the math"


class ExplodingController(AdaptiveController):
    """Importable by the planning process; its plans fail there."""

    def _plan(self, engine, step, drifted=False, before_s=None):
        raise RuntimeError(f"boom at step {step}")


class SlowController(AdaptiveController):
    """Importable by the planning process; there its plans first sleep 30 s (no CPU used: as if
    other work left the process none), on the training thread they are made as usual."""

    def _plan(self, engine, step, drifted=False, before_s=None):
        if planner.background.IN_PLANNING_PROCESS:
            time.sleep(30)
        return super()._plan(engine, step, drifted, before_s)


def _engine_with(controller_cls, tmp_path, **settings):
    model, _, data = skewed_moe()
    config = adaptive_config(tmp_path, 8 * MiB, policy="static")
    config["zinf"]["profiler"]["enabled"] = True
    engine = zinf.initialize(model, config)
    engine.controller = controller_cls(config["zinf"]["profiler"]["db"], engine.recorder, 8 * MiB,
                                       ControllerSettings(replan_every=4, **settings))
    return engine, data


def test_a_plan_failing_in_the_planning_process_is_logged_and_training_goes_on(tmp_path, caplog, planning_process):
    engine, data = _engine_with(ExplodingController, tmp_path, plan_lag_steps=1)
    with engine, caplog.at_level("WARNING"):
        for step in range(12):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        assert engine.global_steps == 12
    failures = [r.getMessage() for r in caplog.records if "ExplodingController failed" in r.getMessage()]
    assert len(failures) >= 2 and "RuntimeError: boom at step 4" in failures[0], "the next plan is tried again"


def test_a_starved_planning_process_leaves_the_plan_to_the_training_thread(tmp_path, caplog):
    """A planning process that gets no CPU while the training thread waits for its plan at the
    lag limit (under SCHED_IDLE, other work keeping the CPUs busy): the training thread kills it
    and makes the plan itself, without waiting for it; after two such plans in a row it plans
    there for the rest of the run."""
    engine, data = _engine_with(SlowController, tmp_path, plan_lag_steps=1,
                                policy=PolicySettings(margin=0, min_gain_fraction=0))
    pc.shared_process().start()  # (a request would wait for CPU that other work may never leave it)
    first = pc.shared_process().pid
    t0 = time.perf_counter()
    with engine, caplog.at_level("WARNING"):
        for step in range(20):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        engine.recorder.flush()
        plans = queries.plans(engine.config.zinf.profiler.db, engine.recorder.run_id)
    assert time.perf_counter() - t0 < 40, "the training thread did not wait for the 30 s plans"
    messages = [r.getMessage() for r in caplog.records]
    starved = [m for m in messages if m.startswith("zinf planner: the planning process got no CPU for the plan due")]
    assert len(starved) == 2 and all("made on the training thread" in m for m in starved), messages
    assert any("2 plans in a row were not made in the planning process" in m for m in messages), messages
    assert not engine.controller.plan_lags, "no plan came from the planning process"
    assert engine.controller.plans_made == len(plans) >= 3, "every plan was made all the same, on the training thread"
    assert first is not None and pc.shared_process().pid != first, "the starved process was killed"


def test_a_plan_that_never_comes_is_given_up_after_the_timeout(tmp_path, caplog, monkeypatch):
    """A planning process that runs but does not answer (never judged starved here) is killed
    after PLAN_TIMEOUT_S at the lag limit: the engine logs it and trains on, and the next plan
    runs in a new process."""
    monkeypatch.setattr(pc, "PLAN_TIMEOUT_S", 1.0)
    monkeypatch.setattr(pc, "STARVED_CPU_FRACTION", 0.0)
    engine, data = _engine_with(SlowController, tmp_path, plan_lag_steps=1)
    pc.shared_process().start()  # (a request would wait for CPU that other work may never leave it)
    first = pc.shared_process().pid
    t0 = time.perf_counter()
    with engine, caplog.at_level("WARNING"):
        for step in range(7):  # one plan, due after step 4 (the next would be due after step 8)
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        assert engine.controller.plans_made == 0
    assert time.perf_counter() - t0 < 25, "the training thread did not wait for the 30 s plan"
    assert any("took over 1 s" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert first is not None and pc.shared_process().pid != first, "the process that did not answer was killed"


def test_a_planning_process_that_cannot_start_leaves_planning_to_the_training_thread(tmp_path, caplog, monkeypatch):
    """Two planning processes dying in a row (here: a Python that is not one) and the controller
    plans on the training thread for the rest of the run, saying so."""
    broken = PlanningProcess(executable="/bin/false")
    monkeypatch.setattr(pc, "shared_process", lambda: broken)
    engine, data = _engine_with(AdaptiveController, tmp_path, plan_lag_steps=1,
                                policy=PolicySettings(margin=0, min_gain_fraction=0))
    with engine, caplog.at_level("WARNING"):
        for step in range(16):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        engine.recorder.flush()
        plans = queries.plans(engine.config.zinf.profiler.db, engine.recorder.run_id)
    messages = [r.getMessage() for r in caplog.records]
    # (the engine logs a failure once per message: the two deaths may read alike)
    assert any("failed after step 5" in m and "the planning process stopped" in m for m in messages), messages
    assert any("2 plans in a row were not made in the planning process (last: the planning process stopped"
               in m and "plans are made on the training thread from now on" in m for m in messages), messages
    assert len(plans) >= 1 and engine.controller.plans_made == len(plans), "the plans after that were made inline"


def test_plans_are_made_elsewhere_by_default_only_with_cpus_to_spare(monkeypatch):
    """Left out of the config, plan_lag_steps is 4 where the process may run on 4 or more CPUs
    and 0 (between steps) on fewer: the planning process needs a CPU that training leaves."""

    c = AdaptiveController("sqlite://", None, 1 << 30, ControllerSettings())
    monkeypatch.setattr(pc.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert c.plan_lag_steps == 0
    monkeypatch.setattr(pc.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert c.plan_lag_steps == pc.DEFAULT_PLAN_LAG_STEPS == 4
    assert AdaptiveController("sqlite://", None, 1 << 30, ControllerSettings(plan_lag_steps=1)).plan_lag_steps == 1
    assert zinf.load_config({"zinf": {"placement": {"plan_lag_steps": 2}}}).zinf.placement.plan_lag_steps == 2
