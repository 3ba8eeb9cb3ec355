"""planner.policy: adoption by predicted gain against migration cost, the warm band, ping-pong."""

from __future__ import annotations

import pytest

from planner.policy import PlacementPolicy, PolicySettings, diff_moves
from zinf.placement import Move

MiB = 1 << 20


def linear_model(step_s_all_nvme: float, saved_s: dict):
    """A stand-in simulator: the step gets shorter by each DRAM home's saved seconds."""
    def predict(placement) -> float:
        return step_s_all_nvme - sum(saved_s[h] for h, t in placement.items() if t == "cpu")
    return predict


def setup(n: int = 6):
    homes = [(f"s{i}", "param") for i in range(n)]
    saved = {h: 0.010 * (i + 1) for i, h in enumerate(homes)}  # s5 hottest
    size = {h: 10 * MiB for h in homes}
    density = {h: saved[h] / size[h] for h in homes}
    return homes, saved, size, density


def decide(policy, current, candidate, saved, size, density, *, room=30 * MiB, horizon=20, move_s=0.01,
           min_gain_fraction=None):
    predict = linear_model(1.0, saved)
    return policy.decide(current, candidate, current_step_s=predict(current), predict_step_s=predict,
                         density=density, dram_bytes=size, dram_room_bytes=room,
                         migration_s=lambda m: move_s, horizon_steps=horizon, min_gain_fraction=min_gain_fraction)


def test_diff_moves_evicts_first_and_skips_unchanged_and_unmovable():
    current = {("a", "param"): "cpu", ("b", "param"): "nvme", ("c", "optim"): "nvme", ("d", "param"): "gpu"}
    target = {("a", "param"): "nvme", ("b", "param"): "cpu", ("c", "optim"): "nvme", ("d", "param"): "cpu"}
    assert diff_moves(current, target) == [Move("a", "param", "nvme"), Move("b", "param", "cpu")]


def test_adopts_a_clear_gain_and_orders_evictions_first():
    homes, saved, size, density = setup()
    current = {h: ("cpu" if i < 3 else "nvme") for i, h in enumerate(homes)}  # the cold first three
    candidate = {h: ("cpu" if i >= 3 else "nvme") for i, h in enumerate(homes)}  # the hot last three
    d = decide(PlacementPolicy(), current, candidate, saved, size, density)
    assert d.adopt, d.reason
    assert [m.dst for m in d.moves] == ["nvme"] * 3 + ["cpu"] * 3
    assert d.gain_s_per_step == pytest.approx(0.09)
    assert d.placement == candidate


def test_refuses_when_migration_cost_beats_the_gain_over_the_horizon():
    homes, saved, size, density = setup()
    current = {h: ("cpu" if i < 3 else "nvme") for i, h in enumerate(homes)}
    candidate = {h: ("cpu" if i >= 3 else "nvme") for i, h in enumerate(homes)}
    # gain 0.09 s/step x 2 steps = 0.18 s; 6 moves x 0.05 s x margin 1.5 = 0.45 s
    d = decide(PlacementPolicy(), current, candidate, saved, size, density, horizon=2, move_s=0.05)
    assert not d.adopt and "does not beat" in d.reason
    # the same plan with a long horizon pays back
    assert decide(PlacementPolicy(), current, candidate, saved, size, density, horizon=50, move_s=0.05).adopt


def test_tiny_gains_are_noise():
    homes, saved, size, density = setup()
    saved = {h: 1e-4 for h in homes}
    density = {h: saved[h] / size[h] for h in homes}
    current = {h: ("cpu" if i < 3 else "nvme") for i, h in enumerate(homes)}
    candidate = dict(current)
    candidate[homes[0]], candidate[homes[5]] = "nvme", "cpu"
    d = decide(PlacementPolicy(PolicySettings(warm_band=0)), current, candidate, saved, size, density,
               horizon=10_000, move_s=0.0)
    assert not d.adopt and "below" in d.reason


def test_a_gain_within_the_models_error_is_not_acted_on():
    """A controller that measured its model off by 15% passes that as the smallest gain worth a
    move: the same plan is adopted below it and refused above it."""
    homes, saved, size, density = setup()
    current = {h: ("cpu" if i < 3 else "nvme") for i, h in enumerate(homes)}
    candidate = dict(current)
    candidate[homes[0]], candidate[homes[5]] = "nvme", "cpu"  # gains 0.06 - 0.01 = 0.05 s of a 0.94 s step
    policy = PlacementPolicy(PolicySettings(warm_band=0))
    assert decide(policy, current, candidate, saved, size, density, horizon=10_000, min_gain_fraction=0.05).adopt
    refused = decide(policy, current, candidate, saved, size, density, horizon=10_000, min_gain_fraction=0.15)
    assert not refused.adopt and "below 15%" in refused.reason


def test_warm_band_keeps_near_threshold_homes_where_they_are():
    homes, saved, size, density = setup(4)
    # s2 (density 0.030/10MiB) is in DRAM; the candidate swaps it for s3 (0.031): 3% better, in the band
    density = {homes[0]: 1e-9, homes[1]: 1e-9, homes[2]: 0.030 / (10 * MiB), homes[3]: 0.031 / (10 * MiB)}
    saved = {h: density[h] * size[h] for h in homes}
    current = {homes[0]: "nvme", homes[1]: "nvme", homes[2]: "cpu", homes[3]: "nvme"}
    candidate = {homes[0]: "nvme", homes[1]: "nvme", homes[2]: "nvme", homes[3]: "cpu"}
    banded = decide(PlacementPolicy(PolicySettings(warm_band=0.15, min_gain_fraction=0)), current, candidate,
                    saved, size, density, room=10 * MiB, horizon=10_000, move_s=0.0)
    # both moves are within the band of the threshold (s3's density): nothing moves
    assert banded.moves == [] and not banded.adopt
    plain = decide(PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0)), current, candidate,
                   saved, size, density, room=10 * MiB, horizon=10_000, move_s=0.0)
    assert plain.adopt and len(plain.moves) == 2


def test_warm_band_gives_way_when_the_homes_it_holds_are_worth_more_than_its_share_of_the_step():
    """Many homes near the threshold (after a routing change): each held move is worth little by
    its density, but together, by the simulator, more than warm_band of the step - the plan is
    taken whole. Worth less than that, the band holds them as before."""
    homes, _, size, _ = setup(6)
    density = {h: (0.030 + 0.0005 * i) / (10 * MiB) for i, h in enumerate(homes)}  # all within 15% of each other
    current = {h: ("cpu" if i < 3 else "nvme") for i, h in enumerate(homes)}
    candidate = {h: ("nvme" if i < 3 else "cpu") for i, h in enumerate(homes)}
    policy = PlacementPolicy(PolicySettings(warm_band=0.15, min_gain_fraction=0, margin=0))
    kw = dict(density=density, dram_bytes=size, dram_room_bytes=30 * MiB, migration_s=lambda m: 0.0,
              horizon_steps=100)
    for saved_each, whole in ((0.001, False), (0.060, True)):  # the 3 swaps: 3 ms or 180 ms of a 1 s step (band: 150)
        def predict(p):
            return 1.0 - saved_each * sum(1 for i, h in enumerate(homes) if p[h] == "cpu" and i >= 3)
        d = policy.decide(current, candidate, current_step_s=predict(current), predict_step_s=predict, **kw)
        if whole:
            assert d.adopt and d.placement == candidate and d.kept_by_warm_band == 0, d.reason
        else:
            assert d.kept_by_warm_band > 0 and d.placement != candidate


def test_warm_band_evicts_kept_homes_again_when_dram_would_overflow():
    homes, saved, size, density = setup(4)
    density = {homes[0]: 0.0290 / (10 * MiB), homes[1]: 0.0295 / (10 * MiB),
               homes[2]: 0.0300 / (10 * MiB), homes[3]: 0.0600 / (10 * MiB)}
    saved = {h: density[h] * size[h] for h in homes}
    current = {homes[0]: "cpu", homes[1]: "cpu", homes[2]: "nvme", homes[3]: "nvme"}
    candidate = {homes[0]: "nvme", homes[1]: "nvme", homes[2]: "cpu", homes[3]: "cpu"}
    d = decide(PlacementPolicy(PolicySettings(warm_band=0.15, min_gain_fraction=0)), current, candidate,
               saved, size, density, room=20 * MiB, horizon=10_000, move_s=0.0)
    in_dram = sum(size[h] for h, t in d.placement.items() if t == "cpu")
    assert in_dram <= 20 * MiB
    assert d.placement[homes[3]] == "cpu", "a clearly hot home is admitted regardless of the band"
    assert d.placement[homes[2]] == "nvme", "s2 is within the band of the threshold: it is not moved in"
    assert d.placement[homes[1]] == "cpu" and d.placement[homes[0]] == "nvme", \
        "of the two near-threshold residents the more valuable one stays; the other makes room"


def test_pingpong_counts_homes_sent_back_within_recent_plans():
    homes, saved, size, density = setup(2)
    policy = PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0, margin=0))
    a = {homes[0]: "cpu", homes[1]: "nvme"}
    b = {homes[0]: "nvme", homes[1]: "cpu"}
    flat = {h: 0.01 for h in homes}
    d1 = policy.decide(a, b, current_step_s=1.0, predict_step_s=lambda p: 0.9, density=flat,
                       dram_bytes=size, dram_room_bytes=10 * MiB, migration_s=lambda m: 0.0, horizon_steps=10)
    assert d1.adopt and d1.pingpong_moves == 0
    policy.adopted(d1, a)
    # the accesses have changed since (a new hot set): going back is allowed, and counted
    d2 = policy.decide(b, a, current_step_s=1.0, predict_step_s=lambda p: 0.9, density=flat,
                       dram_bytes=size, dram_room_bytes=10 * MiB, migration_s=lambda m: 0.0, horizon_steps=10,
                       accesses_changed=True)
    assert d2.adopt and d2.pingpong_moves == 2 and d2.held_back == 0
    policy.adopted(d2, b)
    assert policy.pingpong_total == 2


def test_moves_that_undo_a_recent_plan_are_held_back_while_the_accesses_stay_the_same():
    """Ping-pong damping: with unchanged accesses a plan that would send homes straight back is
    the model re-ordering noise; those homes stay, the rest of the plan goes ahead."""
    homes, saved, size, density = setup(3)
    policy = PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0, margin=0))
    flat = {h: 0.01 for h in homes}
    a = {homes[0]: "cpu", homes[1]: "nvme", homes[2]: "nvme"}
    b = {homes[0]: "nvme", homes[1]: "cpu", homes[2]: "nvme"}
    kw = dict(predict_step_s=lambda p: 0.9, density=flat, dram_bytes=size, migration_s=lambda m: 0.0, horizon_steps=10)
    d1 = policy.decide(a, b, current_step_s=1.0, dram_room_bytes=10 * MiB, **kw)
    policy.adopted(d1, a)
    # straight back to a: both moves would be ping-pong; held, nothing left to adopt
    d2 = policy.decide(b, a, current_step_s=1.0, dram_room_bytes=10 * MiB, **kw)
    assert not d2.adopt and d2.moves == [] and d2.held_back == 2 and "held back" in d2.reason
    # homes[2] in beside homes[1] (20 MiB of room): no home goes back, nothing held
    c = {homes[0]: "nvme", homes[1]: "cpu", homes[2]: "cpu"}
    d3 = policy.decide(b, c, current_step_s=1.0, dram_room_bytes=20 * MiB, **kw)
    assert d3.adopt and d3.held_back == 0 and d3.moves == [Move(homes[2][0], "param", "cpu")]
    # homes[0] back in and homes[1] back out (both undo d1): held; homes[2] comes in
    e = {homes[0]: "cpu", homes[1]: "nvme", homes[2]: "cpu"}
    d4 = policy.decide(b, e, current_step_s=1.0, dram_room_bytes=20 * MiB, **kw)
    assert d4.adopt and d4.held_back == 2 and d4.placement == c and d4.moves == d3.moves
    # holding homes[1] in DRAM would overfill it once homes[2] comes in: the hold is given up
    f = {homes[0]: "nvme", homes[1]: "nvme", homes[2]: "cpu"}
    d5 = policy.decide(b, f, current_step_s=1.0, dram_room_bytes=10 * MiB, **kw)
    assert d5.held_back == 0 and d5.placement == f


def test_gain_scale_discounts_the_predicted_gain_before_it_is_judged():
    """A controller whose plans realised only part of their predicted gains passes that share:
    the same plan is adopted at full trust and refused when its gain, so scaled, is too small."""
    homes, saved, size, density = setup()
    current = {h: ("cpu" if i < 3 else "nvme") for i, h in enumerate(homes)}
    candidate = dict(current)
    candidate[homes[0]], candidate[homes[5]] = "nvme", "cpu"  # 0.05 s of a 0.94 s step
    policy = PlacementPolicy(PolicySettings(warm_band=0))
    full = decide(policy, current, candidate, saved, size, density, horizon=10_000)
    assert full.adopt and full.gain_s_per_step == pytest.approx(0.05)
    kw = dict(current_step_s=0.94, predict_step_s=linear_model(1.0, saved), density=density, dram_bytes=size,
              dram_room_bytes=30 * MiB, migration_s=lambda m: 0.01, horizon_steps=10_000)
    half = policy.decide(current, candidate, gain_scale=0.5, **kw)
    assert half.gain_s_per_step == pytest.approx(0.025) and not half.adopt and "x0.50" in half.reason
    assert not policy.decide(current, candidate, gain_scale=0.0, **kw).adopt


def two_homes_swapped():
    """Two homes, a policy that adopts any gain (hold_rate_change 0.5), the decide() keywords of a
    0.9-of-1.0 s prediction, and the placements a (s0 in DRAM) and b (s1 in DRAM)."""
    homes, saved, size, density = setup(2)
    policy = PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0, margin=0, hold_rate_change=0.5))
    flat = {h: 0.01 for h in homes}
    kw = dict(current_step_s=1.0, predict_step_s=lambda p: 0.9, density=flat, dram_bytes=size,
              dram_room_bytes=10 * MiB, migration_s=lambda m: 0.0, horizon_steps=10)
    a = {homes[0]: "cpu", homes[1]: "nvme"}
    b = {homes[0]: "nvme", homes[1]: "cpu"}
    return homes, policy, kw, a, b


def test_a_home_whose_own_accesses_changed_may_go_back():
    """The ping-pong hold is per home: a home that a recent plan evicted comes back once its own
    accesses per step have changed by more than hold_rate_change since that plan (a new hot
    set), not when they moved by noise."""
    homes, policy, kw, a, b = two_homes_swapped()
    d1 = policy.decide(a, b, rates={"s0": 1.0, "s1": 2.0}, **kw)
    policy.adopted(d1, a, {"s0": 1.0, "s1": 2.0})
    noise = policy.decide(b, a, rates={"s0": 1.4, "s1": 1.5}, **kw)  # |1.4 - 1| <= 0.5 x 1.4; 0.5 <= 0.5 x 2
    assert not noise.adopt and noise.held_back == 2
    swapped = policy.decide(b, a, rates={"s0": 3.0, "s1": 0.5}, **kw)  # both changed by more than half
    assert swapped.adopt and swapped.held_back == 0 and swapped.pingpong_moves == 2
    one = policy.decide(b, {homes[0]: "cpu", homes[1]: "cpu"}, rates={"s0": 3.0, "s1": 2.0},
                        **(kw | {"dram_room_bytes": 20 * MiB}))
    assert one.adopt and one.moves == [Move("s0", "param", "cpu")]
    # 1.0 -> 1.2 accesses a step is within half of 1.2: noise, held
    assert policy.decide(b, a, rates={"s0": 1.2, "s1": 2.0}, **kw).held_back == 2


def test_a_home_whose_accesses_moved_within_their_noise_stays_held():
    """With the caller's noise model (rate_variance), a change by more than hold_rate_change that
    is within hold_noise_z standard deviations of the rates' noise is noise: the return is held;
    a change well beyond the noise still lets the home go back."""
    homes, policy, kw, a, b = two_homes_swapped()
    policy.adopted(policy.decide(a, b, rates={"s0": 1.0, "s1": 2.0}, **kw), a, {"s0": 1.0, "s1": 2.0})
    moved = {"s0": 3.0, "s1": 0.5}  # both by more than half (released without a noise model)
    assert policy.decide(b, a, rates=moved, **kw).held_back == 0
    # 3 accesses/step averaged over ~6 steps of counts with variance 3x their mean: sd ~1.6 > 2/3
    noisy = policy.decide(b, a, rates=moved, rate_variance=3.0 / 6, **kw)
    assert not noisy.adopt and noisy.held_back == 2
    # over ~150 steps the same change is far beyond the noise
    assert policy.decide(b, a, rates=moved, rate_variance=3.0 / 150, **kw).held_back == 0
    # the rates of the plan that moved the homes count with their own noise (an early plan's
    # averaged few steps): given at adoption, they hold the same change back
    early = PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0, margin=0, hold_rate_change=0.5))
    early.adopted(early.decide(a, b, rates={"s0": 1.0, "s1": 2.0}, **kw), a, {"s0": 1.0, "s1": 2.0}, rate_variance=3.0)
    assert early.decide(b, a, rates=moved, rate_variance=3.0 / 150, **kw).held_back == 2


def test_a_per_shard_noise_model_releases_a_home_at_its_cap():
    """rate_variance may give each shard's variance: a hot expert hit in every step (at its cap)
    has none, so its fall from 3 to 0.5 accesses a step after a routing change is a change, where
    a noise model that counts every rate as a Poisson-like count (per access: 3 x rate / 6 steps)
    holds it back."""
    at_cap, fell = {"s0": 3.0, "s1": 3.0}, {"s0": 0.5, "s1": 0.5}
    homes, poisson, kw, a, b = two_homes_swapped()
    poisson.adopted(poisson.decide(a, b, rates=at_cap, **kw), a, at_cap, rate_variance=3.0 / 6)
    held = poisson.decide(b, a, rates=fell, rate_variance=3.0 / 6, **kw)  # sd sqrt(1.5 + 0.25): 3 sd > 2.5
    assert held.held_back == 2 and not held.adopt
    homes, capped, kw, a, b = two_homes_swapped()
    capped.adopted(capped.decide(a, b, rates=at_cap, **kw), a, at_cap, rate_variance={"s0": 0.0, "s1": 0.0})
    released = capped.decide(b, a, rates=fell, rate_variance={"s0": 0.2, "s1": 0.2}, **kw)  # 3 sd = 1.34 < 2.5
    assert released.held_back == 0 and released.adopt
    # still noise when the new rates are that uncertain (3 sd = 3 > 2.5)
    assert capped.decide(b, a, rates=fell, rate_variance={"s0": 1.0, "s1": 1.0}, **kw).held_back == 2


def test_the_homes_a_provisional_plan_moved_may_go_back_without_the_hold():
    """A reaction to a routing change is adopted as provisional (made from a few steps of the new
    accesses): the next plan may undo its moves with accesses unchanged - still counted as
    ping-pong - and the hold applies again to the plan after that one."""
    homes, policy, kw, a, b = two_homes_swapped()
    same = {"s0": 1.0, "s1": 2.0}
    policy.adopted(policy.decide(a, b, rates=same, **kw), a, same, provisional=True)
    back = policy.decide(b, a, rates=same, **kw)
    assert back.adopt and back.held_back == 0 and back.pingpong_moves == 2
    policy.adopted(back, b, same)  # the correction is not provisional: undoing it is held
    again = policy.decide(a, b, rates=same, **kw)
    assert not again.adopt and again.held_back == 2


def test_a_trial_is_taken_whole_within_its_band_and_pays_back_on_the_gain_it_may_have():
    """A trial (the model cannot tell how far off it is: its engine mode never ran) is adopted on
    any predicted gain, below the gate too, not on none; neither the warm band nor the ping-pong
    hold trims it (either would change the mode on trial); its payback counts the band as the
    gain it may have, also where the gains are scaled to 0."""
    homes, saved, size, density = setup(3)
    policy = PlacementPolicy(PolicySettings(warm_band=0.5, min_gain_fraction=0.05, margin=1.5))
    flat = {h: 0.01 for h in homes}
    a = {homes[0]: "cpu", homes[1]: "nvme", homes[2]: "nvme"}
    b = {homes[0]: "nvme", homes[1]: "cpu", homes[2]: "nvme"}
    kw = dict(density=flat, dram_bytes=size, dram_room_bytes=10 * MiB, horizon_steps=10, current_step_s=1.0)
    # (the first plan, a -> b, made without a warm band: with equal densities the band keeps every home)
    d1 = PlacementPolicy(PolicySettings(warm_band=0)).decide(a, b, predict_step_s=lambda p: 0.9,
                                                               migration_s=lambda m: 0.0, **kw)
    assert d1.adopt
    policy.adopted(d1, a)
    # straight back to a, predicted 2% faster: held back and below the 5% gate as a plan ...
    plain = policy.decide(b, a, predict_step_s=lambda p: 0.98, migration_s=lambda m: 0.0, **kw)
    assert not plain.adopt
    # ... adopted whole as a trial (its moves still count as ping-pong)
    trial = policy.decide(b, a, predict_step_s=lambda p: 0.98, migration_s=lambda m: 0.0, trial_band=0.05, **kw)
    assert trial.adopt and trial.placement == a and trial.held_back == 0 and trial.kept_by_warm_band == 0
    assert trial.reason.startswith("a trial") and trial.pingpong_moves == 2
    assert trial.gain_s_per_step == pytest.approx(0.02)
    # predicted slower, but within the band: the model cannot tell, the trial measures it
    slower = policy.decide(b, a, predict_step_s=lambda p: 1.04, migration_s=lambda m: 0.0, trial_band=0.05, **kw)
    assert slower.adopt and slower.gain_s_per_step == pytest.approx(-0.04)
    # predicted the band slower or more: refused
    far = policy.decide(b, a, predict_step_s=lambda p: 1.05, migration_s=lambda m: 0.0, trial_band=0.05, **kw)
    assert not far.adopt and "within 5% of the step in force" in far.reason
    # payback on the gain it may have: (0.02 + 0.05) s x 10 steps = 0.7 s against 1.5 x 2 moves x 0.23 s = 0.69 s
    assert policy.decide(b, a, predict_step_s=lambda p: 0.98, migration_s=lambda m: 0.23, trial_band=0.05, **kw).adopt
    costly = policy.decide(b, a, predict_step_s=lambda p: 0.98, migration_s=lambda m: 0.24, trial_band=0.05, **kw)
    assert not costly.adopt and "does not beat" in costly.reason
    # a gain scale of 0 (a plan realised nothing) does not bar a trial: it is measured; it pays
    # back on the band alone - 0.05 s x 10 steps = 0.5 s against 1.5 x 2 moves x 0.16 s = 0.48 s
    unscaled = policy.decide(b, a, predict_step_s=lambda p: 0.98, migration_s=lambda m: 0.16, trial_band=0.05,
                             gain_scale=0.0, **kw)
    assert unscaled.adopt and unscaled.gain_s_per_step == 0.0
    assert not policy.decide(b, a, predict_step_s=lambda p: 0.98, migration_s=lambda m: 0.17, trial_band=0.05,
                             gain_scale=0.0, **kw).adopt


def test_warm_band_keeps_nothing_out_when_the_plan_leaves_nothing_worth_a_byte_on_nvme():
    """A budget that holds every home: the plan takes them all in, and none is near a threshold
    (there is none), however close their densities are to each other."""
    homes, saved, size, density = setup(4)
    density = {h: (0.030 + 0.001 * i) / (10 * MiB) for i, h in enumerate(homes)}
    saved = {h: density[h] * size[h] for h in homes}
    current = {h: "nvme" for h in homes}
    candidate = {h: "cpu" for h in homes}
    d = decide(PlacementPolicy(PolicySettings(warm_band=0.15, min_gain_fraction=0)), current, candidate,
               saved, size, density, room=40 * MiB, horizon=10_000, move_s=0.0)
    assert d.adopt and d.placement == candidate and d.kept_by_warm_band == 0, d.reason


def test_a_target_the_engine_would_refuse_loses_its_least_valuable_moves_into_dram_until_it_fits():
    """The policy's room counts the homes' own bytes; the engine's count has more (working set,
    homes sharing DRAM). A target over the engine's budget gives up the fewest, least valuable of
    its moves into DRAM, and is judged as it will land."""
    homes, saved, size, density = setup(6)
    current = {h: "nvme" for h in homes}
    candidate = {h: ("cpu" if i >= 2 else "nvme") for i, h in enumerate(homes)}  # s2..s5 in

    def fits(placement) -> bool:  # the engine's count: 5 MiB of working set beyond the homes
        return sum(size[h] for h, t in placement.items() if t == "cpu") + 5 * MiB <= 30 * MiB

    d = PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0)).decide(
        current, candidate, current_step_s=1.0, predict_step_s=linear_model(1.0, saved), density=density,
        dram_bytes=size, dram_room_bytes=40 * MiB, migration_s=lambda m: 0.0, horizon_steps=100, fits=fits)
    # 40 MiB of homes + 5 over 30: the two least valuable moves (s2, s3) are undone, no more
    assert d.left_out == 2 and d.as_reason()["left_out"] == 2
    assert [h for h, t in d.placement.items() if t == "cpu"] == homes[4:]
    assert d.adopt and d.gain_s_per_step == pytest.approx(saved[homes[4]] + saved[homes[5]])
    # a target that fits is left alone
    same = PlacementPolicy(PolicySettings(warm_band=0, min_gain_fraction=0)).decide(
        current, candidate, current_step_s=1.0, predict_step_s=linear_model(1.0, saved), density=density,
        dram_bytes=size, dram_room_bytes=40 * MiB, migration_s=lambda m: 0.0, horizon_steps=100, fits=lambda p: True)
    assert same.left_out == 0 and same.placement == candidate


def test_the_warm_band_can_be_turned_off_for_one_candidate():
    """The controller judges a plan whole when what the band would keep changes the engine mode
    the plan was solved for: the same near-threshold swap the band refuses is taken."""
    homes, saved, size, density = setup(4)
    density = {homes[0]: 1e-9, homes[1]: 1e-9, homes[2]: 0.030 / (10 * MiB), homes[3]: 0.031 / (10 * MiB)}
    saved = {h: density[h] * size[h] for h in homes}
    current = {homes[0]: "nvme", homes[1]: "nvme", homes[2]: "cpu", homes[3]: "nvme"}
    candidate = {homes[0]: "nvme", homes[1]: "nvme", homes[2]: "nvme", homes[3]: "cpu"}
    policy = PlacementPolicy(PolicySettings(warm_band=0.15, min_gain_fraction=0))
    predict = linear_model(1.0, saved)
    kwargs = dict(current_step_s=predict(current), predict_step_s=predict, density=density, dram_bytes=size,
                  dram_room_bytes=10 * MiB, migration_s=lambda m: 0.0, horizon_steps=10_000)
    assert policy.decide(current, candidate, **kwargs).moves == []
    whole = policy.decide(current, candidate, warm_band=False, **kwargs)
    assert whole.adopt and whole.placement == candidate and whole.kept_by_warm_band == 0
