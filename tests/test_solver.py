"""The solver's quality against the exact MILP, and its fast path for large problems.

In the linear regime (``LINEAR`` of ``tests/test_planner.py``: every I/O synchronous, nothing
overlaps compute) the simulator is additive - a home on NVMe costs its own stall seconds whatever
the others do - so the MILP, exact for that model, gives the simulator's optimum. The greedy must
come within 1% of it on every instance; it is never told the MILP's answer.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pandas as pd
import pytest

from planner import PlanError, Simulator, Workload, WorkloadError, simulate, solve
from planner.solver import _fill_in_order

from test_planner import CM, LINEAR

TIERS = ("cpu", "nvme")


def random_instance(seed: int, n: int | None = None) -> tuple[Workload, int]:
    """A random small workload in the linear regime and a room for its homes (bytes).

    3-40 shards, sizes log-uniform 4 KiB - 4 MiB (fp32: 4 B/elem param, 16 B/elem optimizer home
    with its gradient), accesses per step 0.05-4 (conditional use below 1), backward uses 0.5-1x
    the forward's, 15% chunks, 15% frozen, ~5% of the homes pinned to DRAM and ~5% to NVMe, the
    fp32 master aliasing on half of them, and a room of 15-70% of what all homes would take.
    """
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 41)) if n is None else n
    rows = []
    for _ in range(n):
        uses = float(rng.choice([0.05, 0.3, 1.0, 1.0, 2.0, 4.0]))
        row = {"numel": int(np.exp(rng.uniform(np.log(1 << 10), np.log(1 << 20)))),
               "fwd_accesses_per_step": uses, "bwd_accesses_per_step": float(uses * rng.choice([0.5, 1.0, 1.0])),
               "opt_accesses_per_step": float(min(1.0, uses * rng.uniform(0.5, 1.0))),
               "chunk": bool(rng.random() < 0.15), "trainable": bool(rng.random() > 0.15)}
        u = rng.random()
        if u < 0.05:
            row["pin_param"] = "cpu"
        elif u < 0.10:
            row["pin_param"] = "nvme"
        u = rng.random()
        if row["trainable"] and u < 0.05:
            row["pin_optim"] = "cpu"
        elif row["trainable"] and u < 0.10:
            row["pin_optim"] = "nvme"
        rows.append(row)
    wl = Workload.from_rows(rows, compute_fwd_s=float(rng.uniform(0.001, 0.05)), update_s_per_elem=2e-9,
                            update_overhead_s=2e-5, fetch_overhead_s=float(rng.choice([0.0, 5e-5])),
                            aliases_master=bool(rng.random() < 0.5), **LINEAR)
    everything = wl.dram_bytes(wl.all_dram_placement())
    pinned = wl.dram_bytes(wl.all_nvme_placement())
    return wl, max(pinned, int(rng.uniform(0.15, 0.70) * everything))


def assert_valid(wl: Workload, plan, room: int) -> None:
    """Within the room, counted as the engine counts it, and every pin where it is pinned."""
    assert plan.dram_bytes == wl.dram_bytes(plan.placement) <= room
    df = wl.shards
    for name, pin_p, pin_o, trainable in zip(df["shard"], df["pin_param"], df["pin_optim"], df["trainable"]):
        tiers = plan.placement[name]
        assert pin_p is None or tiers["param"] == pin_p, (name, "param", pin_p, tiers)
        assert tiers["optim"] == ((pin_o or tiers["optim"]) if trainable else "none"), (name, "optim", pin_o, tiers)
        assert tiers["param"] in TIERS and (tiers["optim"] in TIERS or not trainable)


def test_greedy_is_within_1pct_of_the_milp_on_200_random_small_instances():
    gaps, density_gaps, bad = [], [], []
    for seed in range(200):
        wl, room = random_instance(seed)
        greedy = solve(wl, CM, room, reserved_bytes=0)
        density = solve(wl, CM, room, reserved_bytes=0, exchange=False)  # the density pass alone
        milp = solve(wl, CM, room, reserved_bytes=0, method="milp")
        for plan in (greedy, milp):
            assert_valid(wl, plan, room)
        assert greedy.note == "" and milp.note == ""  # no evaluation cap hit, HiGHS proved optimality
        best = milp.prediction.step_s
        gap = greedy.prediction.step_s / best - 1
        gaps.append(gap)
        density_gaps.append(density.prediction.step_s / best - 1)
        # the MILP is the optimum here: nothing beats it, beyond rounding
        assert greedy.prediction.step_s >= best * (1 - 1e-9) and density.prediction.step_s >= best * (1 - 1e-9)
        # the exchange search only ever takes a move that simulates faster
        assert greedy.prediction.step_s <= density.prediction.step_s * (1 + 1e-12)
        if gap > 0.01:
            bad.append((seed, len(wl.shards), f"{gap:.2%}"))
    gaps, density_gaps = np.array(gaps), np.array(density_gaps)
    print(f"\ngreedy vs MILP on 200 instances: max {gaps.max():.3%}, mean {gaps.mean():.4%}, "
          f"{(gaps > 0.001).sum()} above 0.1%; the density pass alone: max {density_gaps.max():.2%}, "
          f"mean {density_gaps.mean():.2%}, {(density_gaps > 0.01).sum()} above 1%")
    assert not bad, f"greedy more than 1% slower than the MILP on (seed, shards, gap): {bad}"


@pytest.mark.parametrize("seed", range(10))
def test_in_the_linear_regime_the_milp_is_the_simulators_optimum(seed):
    """The premise of the test above, checked by simulating every placement of a tiny instance
    (at most 10 movable homes): the MILP's plan simulates as fast as the fastest of them, and so
    does the greedy's."""
    wl, room = random_instance(1000 + seed, n=int(np.random.default_rng(seed).integers(3, 6)))
    sim = Simulator(wl, CM)
    fastest = min(sim.predict(placement).step_s for placement in _all_placements(wl, room))
    for method in ("milp", "greedy"):
        plan = solve(wl, CM, room, reserved_bytes=0, method=method)
        assert plan.prediction.step_s == pytest.approx(fastest, rel=1e-9), method


def _all_placements(wl: Workload, room: int):
    """Every placement of ``wl``'s homes that honours the pins and fits ``room`` (tiny instances)."""
    df = wl.shards
    options = []
    for name, pin_p, pin_o, trainable in zip(df["shard"], df["pin_param"], df["pin_optim"], df["trainable"]):
        params = [pin_p] if pin_p else TIERS
        optims = ["none"] if not trainable else [pin_o] if pin_o else TIERS
        options.append([(name, p, o) for p in params for o in optims])
    for combo in itertools.product(*options):
        placement = {name: {"param": p, "optim": o} for name, p, o in combo}
        if wl.dram_bytes(placement) <= room:
            yield placement


def big_workload(n: int, seed: int = 0, **settings) -> Workload:
    """``n`` random shards, 1% of the param homes pinned to DRAM and 1% to NVMe."""
    rng = np.random.default_rng(seed)
    uses = rng.choice([0.05, 0.3, 1.0, 1.0, 2.0], n)
    pin = rng.random(n)
    rows = pd.DataFrame({
        "numel": np.exp(rng.uniform(np.log(1 << 12), np.log(1 << 20), n)).astype(np.int64),
        "fwd_accesses_per_step": uses, "bwd_accesses_per_step": uses, "opt_accesses_per_step": np.minimum(1.0, uses),
        "chunk": rng.random(n) < 0.1, "trainable": rng.random(n) > 0.1,
        "pin_param": np.where(pin < 0.01, "cpu", np.where(pin < 0.02, "nvme", None)),
    })
    return Workload.from_rows(rows, compute_fwd_s=2e-4 * n, update_s_per_elem=2e-9, update_overhead_s=2e-5,
                              fetch_overhead_s=5e-5, **settings)


@pytest.mark.parametrize("aliases_master", [False, True])
def test_the_fast_path_honours_budget_and_pins_and_bounds_its_simulations(aliases_master):
    wl = big_workload(2000, aliases_master=aliases_master, prefetch_bytes=64 << 20, reuse_distance_bytes=1 << 30,
                      disk_servers=4)
    room = int(0.3 * wl.dram_bytes(wl.all_dram_placement()))
    fixed = {wl.names[5]: {"param": "cpu"}, (wl.names[6], "optim"): "nvme"}
    for max_evaluations in (None, 1, 4):
        plan = solve(wl, CM, room, reserved_bytes=0, fixed=fixed, max_evaluations=max_evaluations)
        assert plan.note.startswith("fast path") and plan.method == "greedy"
        assert plan.evaluations <= (max_evaluations or 16)
        assert_valid(wl, plan, room)
        assert plan.placement[wl.names[5]]["param"] == "cpu"
        assert plan.placement[wl.names[6]]["optim"] in ("nvme", "none")
        assert room - plan.dram_bytes < 4 << 20  # the room is filled, to within a few homes
        assert plan.prediction.step_s < simulate(wl, wl.all_nvme_placement(), CM).step_s


def test_in_the_linear_regime_the_fast_path_is_within_a_tenth_of_a_percent_of_the_milp():
    """Many homes small against the room: the density fill loses at most the last home's value."""
    wl = big_workload(600, seed=3, **LINEAR)
    for frac in (0.15, 0.5):
        room = int(frac * wl.dram_bytes(wl.all_dram_placement()))
        fast = solve(wl, CM, room, reserved_bytes=0)
        milp = solve(wl, CM, room, reserved_bytes=0, method="milp")
        assert fast.note.startswith("fast path")
        assert fast.prediction.step_s <= milp.prediction.step_s * 1.001


def test_the_fill_takes_what_still_fits_in_order():
    nbytes = np.array([5, 3, 4, 1, 2, 9])
    order = np.array([0, 1, 2, 3, 4, 5])
    # in 10 bytes, one by one: 5 (5 left), 3 (2 left), not 4, 1 (1 left), not 2, not 9
    taken, free = [], 10
    for c in order:
        if nbytes[c] <= free:
            taken.append(c)
            free -= nbytes[c]
    assert _fill_in_order(order, nbytes, 10).tolist() == taken == [0, 1, 3]
    assert _fill_in_order(np.array([5, 3]), nbytes, 100).tolist() == [5, 3]
    assert _fill_in_order(order, nbytes, 0).tolist() == []


def test_the_caps_on_the_greedy_still_hold():
    wl, room = random_instance(7)
    capped = solve(wl, CM, room, reserved_bytes=0, max_evaluations=5)
    assert capped.evaluations <= 6 and "max_evaluations" in capped.note
    assert_valid(wl, capped, room)
    batched = solve(wl, CM, room, reserved_bytes=0, greedy_batch=3)
    assert_valid(wl, batched, room)


def test_the_scores_table_has_one_row_per_home_in_shard_order():
    wl, room = random_instance(11)
    plan = solve(wl, CM, room, reserved_bytes=0)
    sc = plan.scores
    df = wl.shards
    expected = [(n, s) for n, t in zip(df["shard"], df["trainable"]) for s in (("param", "optim") if t else ("param",))]
    assert list(zip(sc["shard"], sc["state"])) == expected
    assert list(sc.columns) == ["shard", "state", "tier", "movable", "bytes", "saved_s", "saved_s_per_byte",
                                "sim_saved_s", "chosen"]
    assert (sc["chosen"] == sc["tier"].isin(("cpu", "gpu"))).all()
    assert sc["sim_saved_s"].notna().any() and set(plan.timings) >= {"simulate_s", "choose_s"}


def test_unknown_fixed_shards_and_overfull_pins_are_refused():
    wl, room = random_instance(12)
    with pytest.raises(WorkloadError, match="unknown shard"):
        solve(wl, CM, room, reserved_bytes=0, fixed={"no-such-shard": {"param": "cpu"}})
    everything = {n: {"param": "cpu", "optim": "cpu"} for n in wl.names}
    with pytest.raises(PlanError, match="pinned DRAM homes"):
        solve(wl, CM, wl.dram_bytes(everything) - 1, reserved_bytes=0, fixed=everything)


def _moved_bytes(wl: Workload, a: dict, b: dict) -> int:
    """Bytes of the homes whose tier differs between placements ``a`` and ``b``."""
    df = wl.shards.set_index("shard")
    return sum(int(df.at[n, f"{state}_bytes"]) for n in a for state in ("param", "optim") if a[n][state] != b[n][state])


def boundary_instance(seed: int) -> tuple[Workload, Workload, int]:
    """Five shards of like size and nearly equal use, room for two or three of their param homes
    (no optimizer home fits), and the same workload after the uses drifted (their order
    reversed): what is hot changes, a little."""
    rng = np.random.default_rng(seed)
    uses = np.sort(rng.uniform(0.8, 1.2, 5))
    numel = (rng.uniform(0.9, 1.1, 5) * (1 << 18)).astype(int)

    def workload(u):
        rows = [{"numel": int(n), "fwd_accesses_per_step": float(x), "bwd_accesses_per_step": float(x),
                 "opt_accesses_per_step": 1.0} for n, x in zip(numel, u)]
        return Workload.from_rows(rows, compute_fwd_s=0.01, update_s_per_elem=2e-9, **LINEAR)

    before, after = workload(uses), workload(uses[::-1])
    return before, after, int(4 * numel.sum() // 2)


@pytest.mark.parametrize("seed", range(4))
def test_switching_costs_keep_homes_of_nearly_equal_worth_where_they_are(seed):
    """With the placement in force and a cost per byte moved, the MILP moves a home only where
    that pays: its plan is optimal for stall + switching cost (brute force), it moves no more
    bytes as the cost grows, and a prohibitive cost moves nothing."""
    before, drifted, room = boundary_instance(seed)
    incumbent = solve(before, CM, room, reserved_bytes=0, method="milp").placement
    free = solve(drifted, CM, room, reserved_bytes=0, method="milp")
    assert free.placement != incumbent, "the drift must move the unconstrained optimum"
    moved = []
    for per_byte in (0.0, 1e-11, 1e-10, 1e-9, 1e-3):
        plan = solve(drifted, CM, room, reserved_bytes=0, method="milp", incumbent=incumbent, switch_s_per_byte=per_byte)
        assert_valid(drifted, plan, room)
        moved.append(_moved_bytes(drifted, incumbent, plan.placement))
        if per_byte == 0.0:
            assert plan.placement == free.placement
        # brute force over every placement within the room: none is cheaper counting the moves
        total = lambda p: simulate(drifted, p, CM).step_s + per_byte * _moved_bytes(drifted, incumbent, p)
        best = min(total(p) for p in _all_placements(drifted, room))
        assert total(plan.placement) <= best * (1 + 1e-9) + 1e-12
    assert moved == sorted(moved, reverse=True) and moved[0] > 0, moved
    assert moved[-1] == 0, "a prohibitive cost per byte must keep the placement in force"
