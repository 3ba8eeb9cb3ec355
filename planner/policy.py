"""When to act on a new plan, and how: adoption by predicted gain, a warm band, ping-pong counting.

The solver says where every shard *should* live under the DRAM budget. Acting on that is not
free: every move writes or reads the shard's state (a migration), and a plan computed from a few
noisy steps may be undone by the next one. The policy therefore decides, per candidate plan:

1. **Warm band (hysteresis).** A home whose stall saved per byte is within ``warm_band`` (a
   fraction) of the plan's DRAM threshold - between the density of the least valuable home the
   plan keeps in DRAM and the most valuable one it leaves on NVMe - stays where it is: such a move
   buys almost nothing and is the first to flip back.
   If keeping evicted homes in DRAM would break the budget, the lowest-density ones are evicted
   after all. A plan that leaves no home worth anything on NVMe has no threshold, and no band.
   A target the engine would refuse by its own count of DRAM (``fits``: working set, homes that
   share DRAM) gives up its least valuable moves into DRAM until it fits.
2. **Adoption.** The plan (after the warm band) is adopted only when its predicted gain over the
   remaining horizon beats the migration cost by ``margin``:
   ``(current_step_s - plan_step_s) * horizon_steps > margin * migration_s``, and the gain per
   step is at least ``min_gain_fraction`` of the current step (below that the prediction's own
   error dominates).
3. **Order of moves.** Evictions to NVMe first (they free DRAM for what comes in), then the
   homes coming into DRAM, most valuable first; the engine moves at most
   ``migration_bytes_per_step`` a step and defers the rest, which the controller re-issues.
4. **Ping-pong.** A move that returns a home to the tier it left within the last
   ``pingpong_plans`` adopted plans is counted (:attr:`Decision.pingpong_moves`); it is recorded
   with the plan so a user can see a policy that oscillates. Such a move is held back
   (``hold_pingpong``: the home stays where it is, as in the warm band) unless the home's own
   accesses per step have changed by more than ``hold_rate_change`` since the plan that moved it
   (``rates``), and by more than their noise (``hold_noise_z``, given the caller's ``rate_variance``; or the caller says all accesses have changed, ``accesses_changed``). With a few
   tokens a step the hot set re-orders from period to period, and a move undone two plans later
   has cost two migrations for nothing; a home whose accesses really changed (a new hot set)
   goes where it now belongs.
5. **Realised gains.** ``gain_scale`` (from the caller, who measured how much of its plans'
   predicted gains landed) scales every predicted gain before the two tests above: a model that
   has been optimistic stops proposing moves it cannot deliver.

Homes are keyed ``(shard name, state)`` with state ``"param"`` or ``"optim"``; tiers are
``"cpu"`` (DRAM) and ``"nvme"``. Units: seconds (``_s``), bytes (``_bytes``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from zinf.placement import Move

__all__ = ["PolicySettings", "Decision", "PlacementPolicy", "diff_moves"]

Home = tuple[str, str]  # (shard name, "param" | "optim")
MOVABLE_TIERS = ("cpu", "nvme")


@dataclass(frozen=True)
class PolicySettings:
    """Knobs of :class:`PlacementPolicy` (defaults chosen for re-plans every ~20 steps)."""

    margin: float = 1.5
    """The predicted gain over the horizon must exceed the migration seconds times this."""

    min_gain_fraction: float = 0.05
    """Gains below this fraction of the current step time are treated as noise (5%: what a
    landed plan's measurement can tell from noise, ``revert_fraction``)."""

    warm_band: float = 0.15
    """Homes whose saved-seconds-per-byte is within this fraction of the DRAM threshold stay put,
    unless together they are worth more than this fraction of the step (by the simulator)."""

    pingpong_plans: int = 3
    """A home moved back to a tier it left within this many adopted plans counts as ping-pong."""

    hold_pingpong: bool = True
    """Hold back such moves (the home stays where it is) unless the home's accesses have changed."""

    hold_rate_change: float = 0.5
    """A home's accesses per step have changed when they differ from those at the plan that moved
    it by more than this fraction of the larger of the two (and of ``hold_min_accesses``)."""

    hold_min_accesses: float = 0.5
    """Accesses per step below which a difference is noise (an expert hit 0 or 0.2 times a step)."""

    hold_noise_z: float = 3.0
    """With ``rate_variance`` given to :meth:`PlacementPolicy.decide`, a home's accesses have
    changed only if the difference is also more than this many standard deviations of their noise
    (``sqrt(variance then + variance now)``, the first as given to :meth:`adopted`; a
    ``rate_variance`` is either per access per step, the variance being it x the rate, or each
    shard's variance itself): at 16 tokens a step an expert's smoothed accesses moved by half on
    noise alone, which let plans send homes back and forth (ping-pong)."""


@dataclass
class Decision:
    """What the policy made of one candidate plan."""

    adopt: bool
    reason: str
    moves: list[Move] = field(default_factory=list)  # in the order the engine should apply them
    placement: dict[Home, str] = field(default_factory=dict)  # the placement after the moves
    gain_s_per_step: float = 0.0
    migration_s: float = 0.0
    horizon_steps: int = 0
    kept_by_warm_band: int = 0
    pingpong_moves: int = 0
    held_back: int = 0  # moves of the candidate undone because they would have been ping-pong
    left_out: int = 0  # moves into DRAM undone because the engine's own count put the target over the budget
    gain_scale: float = 1.0  # the factor the predicted gain was scaled by (realised / predicted)

    def as_reason(self) -> dict:
        """The JSON the controller stores in ``plans.reason``."""
        return {
            "adopt": self.adopt, "why": self.reason, "moves": len(self.moves),
            "gain_s_per_step": self.gain_s_per_step, "migration_s": self.migration_s,
            "horizon_steps": self.horizon_steps, "kept_by_warm_band": self.kept_by_warm_band,
            "pingpong_moves": self.pingpong_moves, "held_back": self.held_back, "left_out": self.left_out,
            "gain_scale": self.gain_scale,
        }


def _variance_spec(rate_variance: float | Mapping[str, float]) -> float | dict[str, float]:
    """A ``rate_variance`` as :meth:`PlacementPolicy.decide` takes it, checked and copied."""
    if isinstance(rate_variance, Mapping):
        return {k: max(0.0, float(v)) for k, v in rate_variance.items()}
    return max(0.0, float(rate_variance))


def _variance_of(spec: float | Mapping[str, float], shard: str, rate: float) -> float:
    """Variance of ``shard``'s accesses per step ``rate`` under ``spec`` (per access per step, or
    per shard; a shard it does not name: 0)."""
    if isinstance(spec, Mapping):
        return float(spec.get(shard, 0.0))
    return spec * rate


def _remembered(predict_step_s):
    """``predict_step_s`` that simulates each placement once (by its homes' tiers)."""
    seen: dict[tuple, float] = {}

    def predict(placement: Mapping[Home, str]) -> float:
        key = tuple(sorted(placement.items()))
        if key not in seen:
            seen[key] = predict_step_s(placement)
        return seen[key]

    return predict


def diff_moves(current: Mapping[Home, str], target: Mapping[Home, str]) -> list[Move]:
    """The moves from ``current`` to ``target`` between the movable tiers, evictions first."""
    evict, admit = [], []
    for home, dst in target.items():
        src = current.get(home)
        if src == dst or src not in MOVABLE_TIERS or dst not in MOVABLE_TIERS:
            continue
        (evict if dst == "nvme" else admit).append(Move(home[0], home[1], dst))
    return evict + admit


class PlacementPolicy:
    """Decides whether to adopt candidate plans; remembers adopted placements for ping-pong."""

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()
        self._history: deque[dict[Home, str]] = deque(maxlen=max(1, self.settings.pingpong_plans))
        # the accesses per step per shard each of those plans was made from (None: not given)
        self._rates: deque[Mapping[str, float] | None] = deque(maxlen=max(1, self.settings.pingpong_plans))
        self.pingpong_total = 0
        self._rate_variance: float | Mapping[str, float] = 0.0  # of the decide() under way (see hold_noise_z)
        self._variances: deque[float | Mapping[str, float]] = deque(maxlen=max(1, self.settings.pingpong_plans))  # of each remembered plan's rates
        self._provisional: deque[bool] = deque(maxlen=max(1, self.settings.pingpong_plans))  # see adopted()

    def decide(
        self,
        current: Mapping[Home, str],
        candidate: Mapping[Home, str],
        *,
        current_step_s: float,
        predict_step_s: Callable[[Mapping[Home, str]], float],
        density: Mapping[Home, float],
        dram_bytes: Mapping[Home, int],
        dram_room_bytes: int,
        migration_s: Callable[[Move], float],
        horizon_steps: int,
        min_gain_fraction: float | None = None,
        gain_scale: float = 1.0,
        accesses_changed: bool = False,
        rates: Mapping[str, float] | None = None,
        rate_variance: float | Mapping[str, float] = 0.0,
        trial_band: float | None = None,
        fits: Callable[[Mapping[Home, str]], bool] | None = None,
        warm_band: bool = True,
    ) -> Decision:
        """Judge ``candidate`` against ``current`` (both ``{home: tier}``).

        ``predict_step_s(placement)``: the simulator's step time of a placement (the same model
        for both, so that its bias cancels in the gain); ``density``: stall seconds saved per
        byte of each home in DRAM; ``dram_bytes``: DRAM a home takes in DRAM; ``dram_room_bytes``:
        DRAM the homes may take in all (the budget minus working set and buffers);
        ``migration_s(move)``: predicted seconds of one move; ``horizon_steps``: steps left
        (or until the next re-plan window ends) over which a gain pays back;
        ``min_gain_fraction``: overrides the setting of that name (a controller that has
        measured its model's error raises it to that error); ``gain_scale``: the fraction of
        predicted gains that landed plans realised (1: trust the model), applied to the gain
        before it is judged; ``accesses_changed``: the accesses per step have changed since the
        last adopted plans, so any home may go back where it was (no ping-pong hold); ``rates``:
        accesses per step per shard now, against which a home's accesses at the plan that moved
        it are compared (without them, or without those, every return is held); ``rate_variance``:
        the caller's noise model of its smoothed rates, see ``hold_noise_z``: variance per access
        per step (a number), or each shard's variance of its ``rates`` ({shard: variance}); 0 or
        empty: none. ``trial_band``: ``candidate`` is a trial (the model cannot tell it from the
        current placement within this fraction of the step; the caller measures it and reverts
        it unless faster): taken whole (no warm band, no ping-pong hold: either would change the
        engine mode on trial), adopted when the model predicts it less than the band slower than
        the step in force (not only a gain above ``min_gain_fraction``; before ``gain_scale``,
        which may be 0) and the gain it may have (the scaled prediction, if any, + the band of
        the step) pays back its migrations.
        ``fits(placement)``: whether the engine would accept ``placement`` under its DRAM budget,
        by its own count (working set, homes that share DRAM); a target it would not is trimmed
        (:meth:`_fit`) before it is judged. ``warm_band=False``: no warm band for this candidate
        (the caller found that the band would change the engine mode the plan was solved for).
        """
        s = self.settings
        self._rate_variance = _variance_spec(rate_variance)
        min_gain = s.min_gain_fraction if min_gain_fraction is None else min_gain_fraction
        predict_step_s = _remembered(predict_step_s)  # the band's check and the verdict may simulate one target twice
        trial = trial_band is not None
        banded = not trial and warm_band
        target = self._warm_band(current, candidate, density, dram_bytes, dram_room_bytes) if banded else dict(candidate)
        if banded and target != candidate:
            target = self._unless_the_band_holds_the_gain(current_step_s, candidate, target, predict_step_s)
        kept = sum(1 for h, t in candidate.items() if target.get(h) != t)
        held = 0
        if s.hold_pingpong and not accesses_changed and self._history and not trial:
            target, held = self._hold_back(current, target, density, dram_bytes, dram_room_bytes, rates)
        left_out = 0
        if fits is not None:
            target, left_out = self._fit(current, target, density, fits)
        moves = diff_moves(current, target)
        if not moves:
            why = "no home changes tier" + (f" ({held} moves held back: they would undo a recent plan)" if held else "")
            return Decision(False, why, [], dict(current), 0.0, 0.0, horizon_steps, kept, held_back=held,
                            left_out=left_out, gain_scale=gain_scale)
        plan_step_s = predict_step_s(target)
        gain_s = (current_step_s - plan_step_s) * gain_scale
        cost_s = sum(migration_s(m) for m in moves)
        pingpong = self._pingpong(current, moves)
        base = dict(moves=moves, placement=target, gain_s_per_step=gain_s, migration_s=cost_s,
                    horizon_steps=horizon_steps, kept_by_warm_band=kept, pingpong_moves=pingpong,
                    held_back=held, left_out=left_out, gain_scale=gain_scale)
        scaled = f" (x{gain_scale:.2f}: what landed plans realised)" if gain_scale != 1.0 else ""
        # a trial needs the model's unscaled prediction within the band of the step in force,
        # either way: the model cannot tell the two apart by more (the band is its error across
        # engine modes), so the trial's measurement decides (a realised scale of 0 after one
        # reverted plan barred every trial). On the H100 the GPT's all-NVMe placement with updates
        # during backward was predicted 4.7% slower than the plan in force and measured 3-8% faster.
        if trial and plan_step_s >= current_step_s * (1.0 + trial_band):
            why = (f"a trial must be predicted within {trial_band:.0%} of the step in force; "
                   f"{(plan_step_s - current_step_s) * 1e3:.1f} ms/step slower predicted")
            return Decision(False, why, **base)
        if not trial and gain_s < min_gain * current_step_s:
            why = (f"predicted gain {gain_s * 1e3:.1f} ms/step{scaled} is below {min_gain:.0%} "
                   f"of the {current_step_s * 1e3:.1f} ms step")
            return Decision(False, why, **base)
        # a trial pays back on the gain it may have: the model cannot tell it within the band
        payback_s = max(0.0, gain_s) + trial_band * current_step_s if trial else gain_s
        if payback_s * horizon_steps <= s.margin * cost_s:
            why = (f"gain {payback_s * 1e3:.1f} ms/step{scaled}{' (at best, a trial)' if trial else ''} x {horizon_steps} "
                   f"steps does not beat {s.margin:g} x migration {cost_s * 1e3:.1f} ms")
            return Decision(False, why, **base)
        if trial:
            return Decision(True, f"a trial: predicted gain {gain_s * 1e3:.1f} ms/step{scaled} in an engine mode that "
                            f"never ran (its error unknown: {trial_band:.0%} of the {current_step_s * 1e3:.1f} ms step; at best {payback_s * 1e3:.1f} "
                            f"ms/step x {horizon_steps} steps beats {s.margin:g} x migration {cost_s * 1e3:.1f} ms); "
                            f"kept only if measured faster", **base)
        return Decision(True, f"gain {gain_s * 1e3:.1f} ms/step{scaled} x {horizon_steps} steps beats "
                        f"{s.margin:g} x migration {cost_s * 1e3:.1f} ms", **base)

    def adopted(self, decision: Decision, before: Mapping[Home, str], rates: Mapping[str, float] | None = None,
                rate_variance: float | Mapping[str, float] | None = None, provisional: bool = False) -> None:
        """Remember an adopted plan (``before``: the placement it replaced; ``rates``: the accesses
        per step per shard it was made from; ``rate_variance``: their noise as in :meth:`decide`,
        default that of the last decide: an early plan's rates average fewer steps) for ping-pong.
        ``provisional``: the plan was made from a few steps of new accesses (a reaction to a
        routing change); a later plan may send the homes it moved back without the hold - it has
        more steps of the new accesses than the reaction had, and holding a few steps' guess
        against them kept the MoE's step from recovering. Still counted as ping-pong."""
        self._history.append(dict(before))
        self._provisional.append(provisional)
        self._rates.append(dict(rates) if rates is not None else None)
        self._variances.append(self._rate_variance if rate_variance is None else _variance_spec(rate_variance))
        self.pingpong_total += decision.pingpong_moves

    # -- helpers ---------------------------------------------------------------------------
    def _unless_the_band_holds_the_gain(self, current_step_s: float, candidate: Mapping[Home, str],
                                        banded: dict[Home, str], predict_step_s) -> dict[Home, str]:
        """``banded`` (the candidate with the warm band's moves undone), or the candidate whole when
        the moves the band held are together worth more than ``warm_band`` of the step (by the
        simulator, not the linear densities that drew the band). The band is for moves worth
        little, a home or two near the threshold; after a routing change many homes sit near the
        new one, and on the MoE at 20% the band held 72 of a reaction's 104 ms predicted (and
        50-70 ms of every plan after it, each then below its gate): the run stayed 1.16x slower
        than one on the new routing from the start."""
        held_s = predict_step_s(banded) - predict_step_s(candidate)
        return dict(candidate) if held_s > self.settings.warm_band * current_step_s else banded

    def _warm_band(self, current, candidate, density, dram_bytes, room_bytes) -> dict[Home, str]:
        """``candidate`` with near-threshold moves undone, still within ``room_bytes``."""
        band = self.settings.warm_band
        in_dram = [density[h] for h, t in candidate.items() if t == "cpu" and h in density]
        on_nvme = [density[h] for h, t in candidate.items() if t == "nvme" and h in density]
        if band <= 0 or not in_dram:
            return dict(candidate)
        # The plan's boundary: between its least valuable DRAM home and its most valuable NVMe
        # one (geometric mean: densities span orders of magnitude). A plan that leaves no home
        # worth anything on NVMe has none: every home it takes in fits, and no home is near a
        # threshold (the band once kept the least valuable of them out, the frozen-block GPT's
        # optimizer homes, on a budget that held every home).
        lo_in, hi_out = min(in_dram), max(on_nvme, default=0.0)
        threshold = math.sqrt(lo_in * hi_out)
        target = dict(candidate)
        for home, dst in candidate.items():
            src = current.get(home)
            if src == dst or src not in MOVABLE_TIERS or dst not in MOVABLE_TIERS:
                continue
            d = density.get(home, 0.0)
            if dst == "cpu" and d < threshold * (1 + band):
                target[home] = src  # barely worth its DRAM: not worth a move
            elif dst == "nvme" and d > threshold * (1 - band):
                target[home] = src  # barely not worth it: keep it where it is
        # Keeping evictees may overfill DRAM: evict the least valuable kept ones after all.
        used = sum(dram_bytes.get(h, 0) for h, t in target.items() if t == "cpu")
        if used > room_bytes:
            kept_in_dram = sorted((h for h, t in target.items() if t == "cpu" and candidate[h] == "nvme"),
                                  key=lambda h: density.get(h, 0.0))
            for home in kept_in_dram:
                if used <= room_bytes:
                    break
                target[home] = "nvme"
                used -= dram_bytes.get(home, 0)
        if used > room_bytes:  # the warm band cannot be honoured within the budget: take the plan
            return dict(candidate)
        return target

    @staticmethod
    def _fit(current, target, density, fits) -> tuple[dict[Home, str], int]:
        """``target`` with its least valuable moves into DRAM undone until the engine would accept
        it (``fits``), and how many were undone. The warm band and the ping-pong hold keep their
        room by the homes' own bytes; the engine also counts the working set and homes that share
        DRAM, and refuses a move that breaks the budget by its count: a drift run at 20% once
        adopted a target 0.4 MiB over it, whose 4 refused moves the controller re-issued for
        50 steps. (A target that does not fit with every such move undone is returned as it is:
        the engine refuses what does not fit, the controller drops those moves.)"""
        if fits(target):
            return dict(target), 0
        incoming = sorted((h for h, t in target.items()
                           if t == "cpu" and current.get(h) in MOVABLE_TIERS and current.get(h) != "cpu"),
                          key=lambda h: density.get(h, 0.0))

        def undo(m: int) -> dict[Home, str]:  # the target less its m least valuable moves into DRAM
            out = dict(target)
            for home in incoming[:m]:
                out[home] = current[home]
            return out

        if not incoming or not fits(undo(len(incoming))):
            return dict(target), 0
        # the fewest to undo: each home undone frees DRAM, so fitting is monotone in m (each
        # ask is a pass over every shard: a bisection asks ~log2(moves) times)
        lo, hi = 0, len(incoming)  # undo(lo) does not fit, undo(hi) does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(undo(mid)) else (mid, hi)
        return undo(hi), hi

    def _changed(self, home: Home, dst: str, current, rates) -> bool:
        """Whether ``home``'s accesses per step now (``rates``) differ from those of the newest
        remembered plan that moved it away from ``dst`` by more than ``hold_rate_change`` (always,
        if that plan was provisional)."""
        if rates is None:
            return False
        s = self.settings
        for past, then, v_then, provisional in zip(reversed(self._history), reversed(self._rates),
                                                   reversed(self._variances), reversed(self._provisional)):
            if past.get(home) == dst and current.get(home) != dst:  # that plan moved it away
                if provisional:
                    return True
                if then is None or home[0] not in then or home[0] not in rates:
                    return False
                a, b = float(then[home[0]]), float(rates[home[0]])
                noise = s.hold_noise_z * math.sqrt(_variance_of(v_then, home[0], a) + _variance_of(self._rate_variance, home[0], b))
                return abs(a - b) > max(s.hold_rate_change * max(a, b, s.hold_min_accesses), noise)
        return False

    def _hold_back(self, current, target, density, dram_bytes, room_bytes, rates=None) -> tuple[dict[Home, str], int]:
        """``target`` with every move that would be ping-pong undone (the home stays where it is)
        unless the home's accesses have changed since (:meth:`_changed`), still within
        ``room_bytes``: if homes held in DRAM overfill it, the least valuable of them are evicted
        after all. Returns (target, moves held back)."""
        held = dict(target)
        back = {(m.shard, m.state) for m in diff_moves(current, target)
                if self._pingpong(current, [m]) and not self._changed((m.shard, m.state), m.dst, current, rates)}
        for home in back:
            held[home] = current[home]
        # a home's bytes alone over-count homes that share DRAM (a param aliasing its master):
        # the target may be over room_bytes by this count; holding must not add to it
        room_bytes = max(room_bytes, sum(dram_bytes.get(h, 0) for h, t in target.items() if t == "cpu"))
        used = sum(dram_bytes.get(h, 0) for h, t in held.items() if t == "cpu")
        if used > room_bytes:
            in_dram = sorted((h for h in back if held[h] == "cpu"), key=lambda h: density.get(h, 0.0))
            for home in in_dram:
                if used <= room_bytes:
                    break
                held[home] = target[home]
                used -= dram_bytes.get(home, 0)
        if used > room_bytes:  # cannot be held within the budget: take the target as it was
            return dict(target), 0
        return held, sum(1 for h in back if held[h] != target[h])

    def _pingpong(self, current: Mapping[Home, str], moves: list[Move]) -> int:
        """Moves that send a home back to a tier it had in a recently replaced placement."""
        count = 0
        for m in moves:
            home = (m.shard, m.state)
            if any(past.get(home) == m.dst and current.get(home) != m.dst for past in self._history):
                count += 1
        return count
