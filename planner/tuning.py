"""In-training tuning of the I/O settings and the prefetch window (``zinf.autotune``).

DeepSpeed asks the user to run a separate autotuning job; zinf tries a few settings in the first
steps of the real run, measured by the profiler, and keeps the fastest. What is tuned is what the
engine can change between two optimizer steps without changing a single computed value
(:meth:`zinf.engine.Engine.set_io_settings`): the NVMe backend's ``thread_count``,
``block_size`` and ``queue_depth``, and the parameter prefetch window ``prefetch_bytes``.

The search is round-robin coordinate descent from the configured setting (trial 0): each trial is
the best setting so far with one coordinate moved one notch, the coordinates taken in turn
(threads, prefetch window, block size, queue depth), first upwards; a coordinate whose move did
not help is tried downwards next round, then left alone. Notches: threads 1-2-4-8-16 (at most the
CPU count, at least 2), block size 512 KiB-1 MiB-4 MiB, queue depth 4-8-16-32, the window x2 /
x0.5 (within the NVMe param bytes, at least the largest NVMe param shard). A move the engine
refuses (the window does not fit ``zinf.dram_budget``) costs no trial.

A trial is applied after an optimizer step; the next step settles (new threads, buffers
re-sized), the ``steps_per_trial`` after it are measured, and the one after those runs while the
trial is judged (its row reaches the database only when it ends; the switch to the next trial
then happens in that step). Measured = median over the trial's steps of ``steps.wall_s -
steps.migration_s``, read back from the profile database after a recorder flush, so the tuner
sees exactly what the profile says. A trial replaces the best only when it is faster by more
than ``min_gain``; so the configured setting stays unless something beat it clearly. When the
trials are spent (or no move is left) the best is put in force and every trial is recorded in
``tuning_trials`` (``setting`` JSON, ``step_s``, ``step`` = first measured step), the kept one
with ``chosen`` true.

Nothing here may stop training: an error ends the tuning with one log line and puts the best
setting measured so far (else the configured one) back in force.
"""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, field

import torch

from zinf.errors import ZinfError

from profiler import queries

log = logging.getLogger("zinf.planner")

__all__ = ["TuningSettings", "Trial", "IoTuner", "SETTING_KEYS"]

KiB, MiB = 1 << 10, 1 << 20
SETTING_KEYS = ("thread_count", "prefetch_bytes", "block_size", "queue_depth")
"""The coordinates tuned, in the order each round tries them."""
THREAD_NOTCHES = (1, 2, 4, 8, 16)
BLOCK_NOTCHES = (512 * KiB, 1 * MiB, 4 * MiB)
QUEUE_NOTCHES = (4, 8, 16, 32)


@dataclass(frozen=True)
class TuningSettings:
    """How many trials, how long each, when (``zinf.autotune``)."""

    trials: int = 4
    """Settings tried besides the configured one."""

    steps_per_trial: int = 3
    """Steps measured per trial (after one settle step)."""

    start_step: int = 2
    """Optimizer steps before the configured setting is measured as trial 0."""

    min_gain: float = 0.05
    """Fraction by which a trial must beat the best so far to replace it."""

    max_threads: int | None = None
    """Most I/O threads tried; None = the CPU count (at least 2)."""

    @classmethod
    def from_config(cls, autotune) -> "TuningSettings":
        """From a :class:`zinf.config.AutotuneConfig`."""
        return cls(trials=autotune.trials, steps_per_trial=autotune.steps_per_trial,
                   start_step=autotune.start_step, min_gain=autotune.min_gain)

    @property
    def steps_per_trial_total(self) -> int:
        """Steps one trial holds the engine: settle + measured + the step it is judged in."""
        return self.steps_per_trial + 2

    @property
    def last_step(self) -> int:
        """The optimizer step after which tuning has finished at the latest (the kept setting is
        in force from the next step on)."""
        return self.start_step + (self.trials + 1) * self.steps_per_trial_total


@dataclass
class Trial:
    """One setting tried: when it came into force and what it measured."""

    setting: dict[str, int]
    """``thread_count``, ``prefetch_bytes``, ``block_size``, ``queue_depth`` (engine.io_settings)."""
    applied_after: int
    """The optimizer step after which it was put in force."""
    step_s: float | None = None
    """Median measured step seconds (None: no step was recorded)."""
    steps: list[int] = field(default_factory=list)
    """The steps measured."""
    measured: bool = False
    """Whether its steps were read back (a trial cut short by the end of tuning was not)."""

    @property
    def first_measured(self) -> int:
        return self.applied_after + 2

    def measured_range(self, n: int) -> range:
        return range(self.first_measured, self.first_measured + n)


class IoTuner:
    """A placement controller that moves nothing: it tunes ``engine.set_io_settings`` in the
    first steps (see the module docstring), then stays idle.

    ``recorder``: the run's :class:`profiler.Recorder` (flushed before each read; trials are
    recorded through it). ``url``: the profile database (default ``recorder.url``).
    """

    def __init__(self, recorder, settings: TuningSettings | None = None, *, url: str | None = None) -> None:
        self.recorder = recorder
        self.url = url or recorder.url
        self.settings = settings or TuningSettings()
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self.chosen: dict[str, int] | None = None  # the setting kept, once done
        self.done = False
        self.error: str | None = None
        self._tried: set[tuple] = set()
        self._state: dict[str, list[str]] = {}  # coordinate -> directions left to try
        self._turn = 0  # index into SETTING_KEYS of the coordinate whose turn it is
        self._moved: str | None = None  # (coordinate, direction) of the trial running
        self._bounds: tuple[int, int] = (0, 0)  # (NVMe param bytes, largest NVMe param shard)

    # ------------------------------------------------------------------ the engine's hook
    def after_step(self, engine) -> None:
        if self.done:
            return None
        try:
            self._advance(engine)
        except Exception as e:  # never stop training: keep the best measured so far
            self._abort(engine, f"{type(e).__name__}: {e}")
        return None

    def _advance(self, engine) -> None:
        s = self.settings
        step = engine.global_steps
        if not self.trials:
            if step < s.start_step:
                return
            self._bounds = _nvme_param_bytes(engine)
            if not any("nvme" in tiers.values() for tiers in engine.placement.values()):
                self.done = True
                log.info("zinf autotune: nothing on NVMe, no I/O settings to tune")
                return
            base = dict(engine.io_settings)
            self._state = {k: ["up", "down"] for k in SETTING_KEYS}
            self._start(Trial(base, step))
            return
        trial = self.trials[-1]
        if step < trial.applied_after + s.steps_per_trial_total:
            return
        self._measure(trial)
        self._judge(trial)
        if len(self.trials) <= s.trials and self._next_trial(engine, step):
            return
        self._finish(engine)

    def _start(self, trial: Trial) -> None:
        self.trials.append(trial)
        self._tried.add(_key(trial.setting))

    def _measure(self, trial: Trial) -> None:
        """The trial's median step from the profile database (wall minus migration seconds)."""
        self.recorder.flush()
        df = queries.steps(self.url, self.recorder.run_id)
        want = trial.measured_range(self.settings.steps_per_trial)
        rows = df[df["step"].isin(list(want))]
        trial.steps = [int(x) for x in rows["step"]]
        secs = (rows["wall_s"] - rows["migration_s"].fillna(0.0)).dropna()
        trial.step_s = float(statistics.median(secs)) if len(secs) else None
        trial.measured = True

    def _judge(self, trial: Trial) -> None:
        if self.best is None:  # trial 0, the configured setting
            if trial.step_s is None:
                raise ZinfError("no step of the configured setting was recorded in the profile")
            self.best = trial
            return
        moved, self._moved = self._moved, None
        better = trial.step_s is not None and trial.step_s < self.best.step_s * (1.0 - self.settings.min_gain)
        if better:
            self.best = trial  # the same direction gets another go next round
        elif moved is not None and self._state[moved]:
            self._state[moved].pop(0)  # up did not help: down next round; down neither: done

    def _next_trial(self, engine, step: int) -> bool:
        """Put the next candidate in force; False when no move is left."""
        while any(self._state.values()):  # each pass drops a direction or moves to the next coordinate
            key = SETTING_KEYS[self._turn % len(SETTING_KEYS)]
            directions = self._state[key]
            if not directions:
                self._turn += 1
                continue
            value = self._neighbour(key, self.best.setting[key], directions[0])
            setting = dict(self.best.setting, **{key: value}) if value is not None else None
            if setting is None or _key(setting) in self._tried:
                directions.pop(0)
                continue  # the same coordinate's other direction, or the next one
            self._tried.add(_key(setting))
            try:
                engine.set_io_settings(**setting)
            except ZinfError as e:  # does not fit the DRAM budget, ...: not a trial
                log.debug("zinf autotune: skipped %s (%s)", setting, e)
                directions.pop(0)
                continue
            self._turn += 1
            self._moved = key
            self._start(Trial(dict(engine.io_settings), step))
            return True
        return False

    def _neighbour(self, key: str, value: int, direction: str) -> int | None:
        """``value`` of coordinate ``key`` moved one notch ``direction`` (None: no such move)."""
        if key == "prefetch_bytes":
            total, largest = self._bounds
            if value <= 0 or total <= 0:
                return None  # prefetch off (or nothing on NVMe to prefetch): not ours to turn on
            if direction == "up":
                return 2 * value if value < total else None
            down = min(value, total) // 2
            return down if down >= largest and down < value else None
        notches = {"thread_count": THREAD_NOTCHES, "block_size": BLOCK_NOTCHES, "queue_depth": QUEUE_NOTCHES}[key]
        if key == "thread_count":
            cap = self.settings.max_threads or max(2, os.cpu_count() or 2)
            notches = tuple(n for n in notches if n <= cap)
        if direction == "up":
            return next((n for n in notches if n > value), None)
        return next((n for n in reversed(notches) if n < value), None)

    # ------------------------------------------------------------------ the end
    def _put(self, engine, trial: Trial) -> None:
        """Put ``trial``'s setting in force for the rest of the run. A window equal to the
        configured one is left to the config's rule (so later migrations re-size it as usual)."""
        base = self.trials[0].setting
        if trial.setting["prefetch_bytes"] == base["prefetch_bytes"]:
            engine.reset_io_settings()
            aio = {k: trial.setting[k] for k in ("block_size", "queue_depth", "thread_count")}
            if any(base[k] != v for k, v in aio.items()):
                engine.set_io_settings(**aio)
        elif dict(engine.io_settings) != trial.setting:
            engine.set_io_settings(**trial.setting)

    def _finish(self, engine) -> None:
        best = self.best
        base = self.trials[0]
        self._put(engine, best)
        self.chosen = dict(engine.io_settings)
        self._record(best)
        self.done = True
        log.info("zinf autotune: %d trials; kept %s (%.4f s/step; configured %.4f s/step)",
                 len(self.trials), _show(self.chosen), best.step_s, base.step_s)

    def _abort(self, engine, why: str) -> None:
        self.done = True
        self.error = why
        keep = self.best
        try:
            if keep is not None:
                self._put(engine, keep)
            elif self.trials:
                engine.reset_io_settings()
            self.chosen = dict(engine.io_settings)
        except Exception as e:  # keep what is in force
            keep = None
            why = f"{why}; could not restore a measured setting ({type(e).__name__}: {e})"
        try:
            self._record(keep)
        except Exception:
            pass
        log.warning("zinf autotune stopped at step %d: %s; training goes on with %s", engine.global_steps, why,
                    _show(engine.io_settings))

    def _record(self, chosen: Trial | None) -> None:
        for t in self.trials:
            if not t.measured:
                continue  # cut short (tuning stopped during it)
            self.recorder.record_tuning_trial(t.setting, t.step_s, chosen=t is chosen,
                                              step=t.steps[0] if t.steps else t.first_measured)


def _nvme_param_bytes(engine) -> tuple[int, int]:
    """(bytes of all param homes on NVMe, bytes of the largest one), in the compute dtype."""
    elem = engine.dtype.itemsize
    placement = engine.placement
    sizes = [s.numel * elem for s in engine.shards if placement[s.name]["param"] == "nvme"]
    return sum(sizes), max(sizes, default=0)


def _key(setting: dict) -> tuple:
    return tuple(int(setting[k]) for k in SETTING_KEYS)


def _show(setting: dict) -> str:
    return (f"thread_count={setting['thread_count']}, block_size={setting['block_size'] // KiB} KiB, "
            f"queue_depth={setting['queue_depth']}, prefetch={setting['prefetch_bytes'] / MiB:.2f} MiB")
