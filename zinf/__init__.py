"""zinf: train PyTorch models whose state does not fit in GPU memory or DRAM.

Public contract (docs/architecture.md)::

    engine = zinf.initialize(model, config)   # config: dict, path to a JSON file, or zinf.Config
    loss = engine(x, y); engine.backward(loss); engine.step()
    engine.save_checkpoint(dir); engine.load_checkpoint(dir)
    engine.state_dict(); engine.placement; engine.close()
    zinf.will_use(modules)                    # in a model's forward: these run next (routed experts)
"""

from __future__ import annotations

import os
from dataclasses import replace

from zinf import errors
from zinf.config import Config, load_config
from zinf.engine import Engine
from zinf.errors import ZinfError
from zinf.events import Recorder
from zinf.hints import will_use
from zinf.placement import ChainedController, PlacementController

__version__ = "0.1.0"
__all__ = ["initialize", "will_use", "Engine", "Config", "load_config", "errors", "ZinfError", "__version__"]


def initialize(model, config: Config | dict | str | os.PathLike | None = None, *, recorder: Recorder | None = None,
               controller: PlacementController | None = None) -> Engine:
    """Wrap ``model`` for training with its state placed as ``config`` says.

    This is the composition root: when ``zinf.profiler.enabled`` is set it attaches the
    profiler's SQLite recorder (the engine itself never imports the profiler). ``controller``
    (e.g. the planner's) is asked for migrations after every optimizer step
    (:class:`zinf.placement.PlacementController`); it can also be set later as ``engine.controller``.
    With ``zinf.autotune.enabled`` the I/O tuner (``planner.tuning.IoTuner``) runs first, chained
    before that controller (:class:`zinf.placement.ChainedController`); the adaptive planner's first
    plan then waits until tuning is over and a full planning window has run with the kept setting.
    """
    cfg = load_config(config)
    prof = cfg.zinf.profiler
    adaptive = cfg.zinf.placement.policy == "adaptive" and controller is None
    autotune = cfg.zinf.autotune.enabled
    if adaptive:
        _check_adaptive(cfg, recorder)
    if autotune:
        _check_autotune(cfg, recorder)
    if recorder is None and (prof.enabled or adaptive or autotune):  # both measure through the profile
        from profiler import Recorder as DbRecorder

        recorder = DbRecorder(prof.db, detail=prof.detail, window_steps=prof.window_steps,
                              flush_interval_s=prof.flush_interval_s, heartbeat_s=prof.heartbeat_s)
    try:
        tuner = None
        if autotune:
            from planner.tuning import IoTuner, TuningSettings

            tuner = IoTuner(recorder, TuningSettings.from_config(cfg.zinf.autotune))
        if adaptive:
            from planner.controller import AdaptiveController, ControllerSettings
            from planner.policy import PolicySettings

            pc = cfg.zinf.placement
            policy = PolicySettings(margin=pc.adopt_margin, min_gain_fraction=pc.min_gain_fraction,
                                    warm_band=pc.warm_band)
            settings = ControllerSettings(replan_every=pc.replan_every, policy=policy,
                                          revert_fraction=pc.revert_fraction, plan_lag_steps=pc.plan_lag_steps,
                                          trial_band=pc.trial_band, trial_periods=pc.trial_periods,
                                          trial_confirm_z=pc.trial_confirm_z)
            if tuner is not None:
                # Trials must not feed the planner's calibration: its first plan reads only steps
                # run with the kept setting (a whole planning window of them).
                settings = replace(settings, first_plan_after=tuner.settings.last_step + settings.window_steps)
            controller = AdaptiveController(prof.db, recorder, int(cfg.zinf.dram_budget), settings)
        if tuner is not None:
            controller = tuner if controller is None else ChainedController(tuner, controller)
        return Engine(model, cfg, recorder=recorder, controller=controller)
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise


def _check_autotune(cfg: Config, recorder) -> None:
    """The autotuner measures its trials through the profile database: it must be recorded."""
    prof = cfg.zinf.profiler
    if not prof.enabled and "enabled" in prof.model_fields_set:
        raise errors.ConfigError(
            "zinf.autotune.enabled measures its trials through the profiler, but zinf.profiler.enabled is false; "
            "remove that key or set it to true (or turn autotune off)")
    if recorder is not None and not (hasattr(recorder, "record_tuning_trial") and hasattr(recorder, "url")):
        raise errors.ConfigError(
            "zinf.autotune.enabled needs the profiler's database recorder; do not pass recorder=, "
            "or pass a profiler.Recorder")


def _check_adaptive(cfg: Config, recorder) -> None:
    """The adaptive policy plans from the profile database under the DRAM budget: both must exist."""
    prof = cfg.zinf.profiler
    if cfg.zinf.dram_budget is None:
        raise errors.ConfigError(
            "zinf.placement.policy 'adaptive' needs zinf.dram_budget, the DRAM it may fill with hot shards "
            "(e.g. \"dram_budget\": \"8GiB\")")
    if not prof.enabled and "enabled" in prof.model_fields_set:
        raise errors.ConfigError(
            "zinf.placement.policy 'adaptive' plans from the profile, but zinf.profiler.enabled is false; "
            "remove that key or set it to true")
    if prof.detail != "shard":
        raise errors.ConfigError(
            "zinf.placement.policy 'adaptive' needs per-shard accesses: set zinf.profiler.detail to 'shard'")
    if recorder is not None and not hasattr(recorder, "record_plan"):
        raise errors.ConfigError(
            "zinf.placement.policy 'adaptive' needs the profiler's database recorder; do not pass recorder=, "
            "or pass controller= yourself")
