"""The adaptive placement controller: re-plans from the profile while training runs.

``zinf.placement.policy: adaptive`` attaches an :class:`AdaptiveController` to the engine
(:func:`zinf.initialize` wires it; the engine only knows the ``after_step`` hook). After every
optimizer step the engine asks it for moves:

1. While a plan is being applied it re-issues what is left of it (the engine moves at most
   ``zinf.placement.migration_bytes_per_step`` a step and defers the rest).
2. Otherwise, every ``replan_every`` steps - or earlier, when the measured step drifts from the
   adopted plan's prediction by more than ``drift_fraction`` - it plans:

   * flushes the profiler so the database holds the newest steps, and reads the steps since the
     last placement change (at most ``window_steps``): :meth:`planner.workload.Workload.from_profile`
     (accesses per step smoothed by EWMA), :meth:`planner.costmodel.CostModel.from_db` (fitted from
     this run's I/O samples);
   * calibrates the simulator on the measured placement (:func:`planner.simulator.calibrate`),
     solves under the DRAM budget (:func:`planner.solver.solve`), and lets the policy
     (:class:`planner.policy.PlacementPolicy`) judge the candidate against the current placement
     over a horizon of ``horizon_plans`` re-plan periods;
   * records the plan (adopted or not, with the policy's reasons) through the recorder
     (``plans``, ``plan_assignments``), and returns the moves of an adopted plan.

Nothing here may stop training: a plan that cannot be made (no NVMe samples yet, a budget the pins
already fill) is skipped with one log line and retried at the next period.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from zinf.errors import ZinfError
from zinf.placement import Move

from planner.costmodel import CostModel
from planner.policy import Decision, PlacementPolicy, PolicySettings, diff_moves
from planner.simulator import Simulator, calibrate
from planner.solver import Plan, PlanError, homes_of, solve
from planner.workload import Workload

log = logging.getLogger("zinf.planner")

__all__ = ["ControllerSettings", "AdaptiveController"]

Home = tuple[str, str]


@dataclass(frozen=True)
class ControllerSettings:
    """How often and from what the controller plans."""

    replan_every: int = 20
    """Optimizer steps between plans (``zinf.placement.replan_every``)."""

    first_plan_after: int = 3
    """Steps measured before the first plan: the first records the trace, the next calibrate."""

    window_steps: int = 20
    """Newest steps (since the last placement change) that a plan is made from."""

    drift_fraction: float = 0.25
    """Re-plan early when the measured median step differs from the prediction by this fraction."""

    drift_steps: int = 3
    """Steps whose median is compared with the prediction (after a plan has fully landed)."""

    horizon_plans: int = 4
    """Re-plan periods over which a plan's gain must pay back its migrations."""

    policy: PolicySettings = field(default_factory=PolicySettings)


class _BudgetFull(PlanError):
    """Every split of the budget is taken by the placement in force: nothing to re-plan."""


class AdaptiveController:
    """Plans placements from the profile database at ``url`` and hands the engine the moves.

    ``recorder``: the run's :class:`profiler.Recorder` (flushed before reading; plans are
    recorded through it). ``dram_budget_bytes``: ``zinf.dram_budget``.
    """

    def __init__(self, url: str, recorder, dram_budget_bytes: int, settings: ControllerSettings | None = None) -> None:
        self.url = url
        self.recorder = recorder
        self.dram_budget_bytes = int(dram_budget_bytes)
        self.settings = settings or ControllerSettings()
        self.policy = PlacementPolicy(self.settings.policy)
        self.plans_made = 0
        self.plans_adopted = 0
        self.last_decision: Decision | None = None
        self.last_plan: Plan | None = None
        self.last_skip: str | None = None
        self._target: dict[Home, str] | None = None  # the adopted placement still being applied
        self._predicted_step_s: float | None = None  # of the placement in force
        self._settled_step = 0  # the step after which the current placement was complete
        self._last_plan_step = 0
        self._recent_s: deque[float] = deque(maxlen=max(1, self.settings.drift_steps))
        self._warned: set[str] = set()
        # Measured cost of this engine's migrations (seconds per byte moved, all overheads in),
        # from the reports of the moves it applied; None until one moved bytes.
        self.migration_s_per_byte: float | None = None
        self._seen_report = None

    # ------------------------------------------------------------------ the engine's hook
    def after_step(self, engine) -> list[Move] | None:
        step = engine.global_steps
        self._learn_migration_cost(getattr(engine, "last_migration", None))
        last = getattr(engine, "last_step", None)  # the previous step's {"wall_s": ...}
        if last and last.get("wall_s") is not None and self._target is None:
            self._recent_s.append(float(last["wall_s"]))
        if self._target is not None:
            left = diff_moves(homes_of(engine.placement), self._target)
            if left:
                return left
            self._target = None  # the plan has landed: measure from here on
            self._settled_step = step
            self._recent_s.clear()
        s = self.settings
        if step - self._settled_step < s.first_plan_after:
            return None
        drifted = self._drifted()
        if not drifted and step - self._last_plan_step < s.replan_every:
            return None
        self._last_plan_step = step
        self._recent_s.clear()  # drift is judged on steps after this plan
        try:
            return self._plan(engine, step, drifted)
        except _BudgetFull as e:  # the placement in force already fills the budget: normal
            self.last_skip = str(e)
            log.info("zinf planner: step %d: %s", step, e)
            return None
        except ZinfError as e:  # not enough data yet, a budget the pins fill, ...
            self._skip(str(e))
            return None

    # ------------------------------------------------------------------ planning
    def _plan(self, engine, step: int, drifted: bool = False) -> list[Move] | None:
        s = self.settings
        self.recorder.flush()
        run_id = self.recorder.run_id
        since = step - self._settled_step
        # A drift means the recent steps no longer look like the older ones: plan from the short
        # EWMA of the accesses then; a scheduled plan smooths over the longer one.
        # The long EWMA's halflife is one re-plan period (a plan has to pay back within a few
        # periods, so older behaviour matters less), the short one a quarter of it.
        workload = Workload.from_profile(self.url, run_id, last_steps=max(2, min(s.window_steps, since)),
                                         rate="short" if drifted else "long",
                                         long_halflife_steps=float(s.replan_every),
                                         short_halflife_steps=max(1.0, s.replan_every / 4))
        cost = CostModel.from_db(self.url, run_id)
        overlap = engine.overlap
        workload = calibrate(workload, cost, placement=engine.placement, prefetch_bytes=overlap.prefetch_bytes)
        plan, sim = self._best_plan(engine, workload, cost)
        now_sim = Simulator(workload, cost, prefetch_bytes=overlap.prefetch_bytes)
        current = homes_of(engine.placement)
        shards = workload.shards.set_index("shard")

        def move_s(m: Move) -> float:
            nbytes = int(shards.at[m.shard, "param_bytes" if m.state == "param" else "optim_bytes"])
            if self.migration_s_per_byte is not None:  # what this engine's moves really took
                return nbytes * self.migration_s_per_byte
            return float(cost.predict_s("nvme", "write" if m.dst == "nvme" else "read", nbytes))

        # The current placement with the overlap buffers it has; candidates with the buffers the
        # chosen plan leaves room for (the engine re-sizes them from what the homes leave).
        current_step_s = now_sim.predict(current).step_s
        density = plan.density()
        decision = self.policy.decide(
            current, plan.homes(), current_step_s=current_step_s,
            predict_step_s=lambda homes: sim.predict(homes).step_s,
            density=density, dram_bytes=plan.home_bytes(), dram_room_bytes=plan.room_bytes,
            migration_s=move_s, horizon_steps=s.replan_every * s.horizon_plans,
        )
        self.plans_made += 1
        self.last_plan, self.last_decision = plan, decision
        predicted_s = sim.predict(decision.placement).step_s
        reason = decision.as_reason() | {
            "current_step_s": current_step_s, "measured_step_s": workload.measured_step_s,
            "solver": plan.method, "solver_s": plan.solve_s, "note": plan.note, "trigger": "drift" if drifted else "schedule",
        }
        assignments = [
            {"shard": name, "param_tier": decision.placement.get((name, "param"), tiers["param"]),
             "optim_tier": decision.placement.get((name, "optim"), tiers["optim"]),
             "score": density.get((name, "param"), 0.0) + density.get((name, "optim"), 0.0)}
            for name, tiers in engine.placement.items()
        ]
        self.recorder.record_plan(
            self.plans_made, assignments, policy="adaptive", created_step=step,
            dram_budget_bytes=self.dram_budget_bytes, predicted_step_s=predicted_s,
            predicted_gain_s=decision.gain_s_per_step, adopted=decision.adopt, reason=reason,
        )
        log.info("zinf planner: step %d plan %d %s: %s", step, self.plans_made,
                 "adopted" if decision.adopt else "kept the current placement", decision.reason)
        if not decision.adopt:
            self._predicted_step_s = current_step_s
            return None
        self.plans_adopted += 1
        self.policy.adopted(decision, current)
        engine.plan_version += 1
        self._target = decision.placement
        self._predicted_step_s = predicted_s
        return decision.moves

    def _best_plan(self, engine, workload: Workload, cost) -> tuple[Plan, Simulator]:
        """The fastest predicted plan over a few ways of splitting the budget between homes and
        the engine's overlap buffers.

        The engine sizes its buffers from what the budget leaves (an all-NVMe start gives the
        whole rest to the prefetch window), so the room for hot homes is a choice: keep the
        buffers as they are; keep the fixed ones (write-behind, optimizer read-ahead, updates
        during backward) and a prefetch window of a useful size (max(2 x largest param shard, 10%
        of all params)); drop the updates during backward; drop prefetch too (worth it when the
        params themselves fit in DRAM). Each is solved by the MILP (cheap); the best one again by
        the greedy (re-simulating), and the faster of those two plans is kept. Dropping the
        write-behind or the read-ahead too is what DeepSpeed-style ``max_in_cpu`` ends up doing when
        its params take the budget: it can pay when param reads dominate (accumulation).
        """
        need, ov = engine.dram_need, engine.overlap
        param_bytes = workload.shards["param_bytes"]
        useful_prefetch = min(ov.prefetch_bytes, max(2 * int(param_bytes.max()), int(param_bytes.sum()) // 10))
        fixed = need.working_bytes + need.staging_bytes
        write, read = ov.write_bytes, ov.read_ahead_bytes
        # label: (prefetch window, updates during backward, write-behind, read-ahead) -> bytes reserved
        options = {
            "buffers as now": (ov.prefetch_bytes, ov.eager, True, True),
            "useful prefetch": (useful_prefetch, ov.eager, True, True),
            "no updates in backward": (useful_prefetch, False, True, True),
            "no prefetch": (0, False, True, True),
            "no prefetch, no write-behind": (0, False, False, True),
            "no overlap buffers": (0, False, False, False),
        }
        best: tuple[Plan, Workload, int] | None = None
        for label, (prefetch, eager, keep_write, keep_read) in options.items():
            buffers = prefetch + (ov.eager_bytes if eager else 0) + (write if keep_write else 0) + (read if keep_read else 0)
            wl = replace(workload, updates_during_backward=bool(eager and workload.updates_during_backward),
                         prefetch_bytes=int(prefetch),
                         write_window_bytes=workload.write_window_bytes if keep_write else 0,
                         pipeline_read=workload.pipeline_read and keep_read)
            plan, reserved = self._solve_with_working_set(engine, wl, cost, fixed, buffers)
            if plan is None:
                continue  # this split leaves no room at all
            plan.note = f"{plan.note}; buffers: {label}".lstrip("; ")
            if best is None or plan.prediction.step_s < best[0].prediction.step_s:
                best = (plan, wl, reserved)
        if best is None:
            raise _BudgetFull("no split of zinf.dram_budget between homes and buffers leaves room for another plan")
        plan, wl, reserved = best
        greedy = solve(wl, cost, self.dram_budget_bytes, reserved_bytes=reserved, prefetch_bytes=wl.prefetch_bytes,
                       method="greedy")
        greedy.note = plan.note
        if greedy.prediction.step_s < plan.prediction.step_s:
            plan = greedy
        return plan, Simulator(wl, cost, prefetch_bytes=wl.prefetch_bytes)

    def _solve_with_working_set(self, engine, wl: Workload, cost, fixed: int, buffers: int):
        """MILP plan with ``buffers`` bytes of overlap buffers, its room refined twice by the
        working set the engine would have with the plan (smaller once params are resident), so
        long as the refined plan still fits the budget by the engine's own count. Returns
        ``(plan, reserved_bytes)``, or ``(None, 0)`` when this split leaves no room."""
        staging = engine.dram_need.staging_bytes
        reserved = fixed + buffers
        plan = None
        for _ in range(3):
            try:
                candidate = solve(wl, cost, self.dram_budget_bytes, reserved_bytes=reserved,
                                  prefetch_bytes=wl.prefetch_bytes, method="milp")
            except PlanError:
                break
            need = engine.dram_need_of(candidate.placement)
            if need.total_bytes + buffers > self.dram_budget_bytes:
                break  # the smaller working set assumed does not hold for this plan: keep the last
            plan, used_reserved = candidate, reserved
            refined = need.working_bytes + staging + buffers
            if refined >= reserved:
                break
            reserved = refined
        return (plan, used_reserved) if plan is not None else (None, 0)

    def _learn_migration_cost(self, report) -> None:
        """Fold a new migration report into :attr:`migration_s_per_byte` (EWMA, weight 1/2): a
        move costs more than its disk I/O (verification read-back, buffer re-sizing), and the
        adoption test must weigh what moves really cost."""
        if report is None or report is self._seen_report:
            return
        self._seen_report = report
        if report.bytes_moved <= 0 or report.seconds <= 0:
            return
        rate = report.seconds / report.bytes_moved
        old = self.migration_s_per_byte
        self.migration_s_per_byte = rate if old is None else 0.5 * (old + rate)

    def _drifted(self) -> bool:
        """The placement has landed and its measured median step is far from the prediction."""
        s = self.settings
        if self._predicted_step_s is None or len(self._recent_s) < s.drift_steps:
            return False
        measured = statistics.median(self._recent_s)
        return abs(measured - self._predicted_step_s) > s.drift_fraction * self._predicted_step_s

    def _skip(self, why: str) -> None:
        self.last_skip = why
        if why not in self._warned:
            self._warned.add(why)
            log.warning("zinf planner: no plan this period: %s", why)
