"""zinf: train PyTorch models whose state does not fit in GPU memory or DRAM.

Public contract (docs/architecture.md)::

    engine = zinf.initialize(model, config)   # config: dict, path to a JSON file, or zinf.Config
    loss = engine(x, y); engine.backward(loss); engine.step()
    engine.save_checkpoint(dir); engine.load_checkpoint(dir)
    engine.state_dict(); engine.placement; engine.close()
"""

from __future__ import annotations

import os

from zinf import errors
from zinf.config import Config, load_config
from zinf.engine import Engine
from zinf.errors import ZinfError
from zinf.events import Recorder
from zinf.placement import PlacementController

__version__ = "0.1.0"
__all__ = ["initialize", "Engine", "Config", "load_config", "errors", "ZinfError", "__version__"]


def initialize(model, config: Config | dict | str | os.PathLike | None = None, *, recorder: Recorder | None = None,
               controller: PlacementController | None = None) -> Engine:
    """Wrap ``model`` for training with its state placed as ``config`` says.

    This is the composition root: when ``zinf.profiler.enabled`` is set it attaches the
    profiler's SQLite recorder (the engine itself never imports the profiler). ``controller``
    (e.g. the planner's) is asked for migrations after every optimizer step
    (:class:`zinf.placement.PlacementController`); it can also be set later as ``engine.controller``.
    """
    cfg = load_config(config)
    if recorder is None and cfg.zinf.profiler.enabled:
        from profiler import Recorder as DbRecorder

        prof = cfg.zinf.profiler
        recorder = DbRecorder(prof.db, detail=prof.detail, window_steps=prof.window_steps,
                              flush_interval_s=prof.flush_interval_s, heartbeat_s=prof.heartbeat_s)
    try:
        return Engine(model, cfg, recorder=recorder, controller=controller)
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise
