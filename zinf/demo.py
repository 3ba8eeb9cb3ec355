"""``zinf demo``: the README's main job.

Trains the built-in GPT on synthetic Markov-chain tokens with its state split between DRAM and
NVMe under a DRAM budget smaller than the model state, with the profiler recording into an
SQLite file, then prints where the time and the bytes went. Everything it writes lives under the
working directory: ``zinf-swap/`` (removed at the end), ``zinf-profile.db`` and
``zinf-checkpoints/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

import zinf
from zinf.events import FanoutRecorder, ListRecorder, ShardMigrated, StepFinished
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens
from zinf.placement import fmt_bytes


@dataclass
class DemoSettings:
    steps: int = 60
    """Optimizer steps to train."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    workdir: Path = Path(".")
    """Where the swap directory, profile database and checkpoint go."""
    dram_fraction: float = 0.5
    """DRAM budget as a fraction of the model's training state (params + grads + Adam state)."""
    profile: bool = True
    """Record into ``<workdir>/zinf-profile.db``."""
    preset: str = "demo"
    """Model size preset of the built-in GPT."""
    adaptive: bool = True
    """Re-plan the placement from the profile while training and migrate between steps
    (``zinf.placement.policy: adaptive``; needs ``profile``)."""
    replan_every: int = 10
    """Steps between re-plans (adaptive)."""


def demo_config(model, settings: DemoSettings) -> dict:
    """The config the demo trains with: params and optimizer state on NVMe to start with (the
    seed article's ZeRO-Infinity config as written), under a DRAM budget of ``dram_fraction`` of
    the state; with ``adaptive`` (and the profiler on) the planner then moves into that budget the
    homes the profile says earn it. (From DeepSpeed's ``max_in_cpu`` start - the first quarter of
    the params in DRAM - the dense GPT is already near the best placement the planner can measure,
    and on the 2-core VM no plan cleared its noise gate: the demo showed no migration.)"""
    n = sum(p.numel() for p in model.parameters())
    state_bytes = n * (4 + 4 + 4 + 4 + 4)  # param, grad, master, exp_avg, exp_avg_sq (fp32)
    swap = str(settings.workdir / "zinf-swap")
    return {
        "train_micro_batch_size_per_gpu": settings.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2},
        "zinf": {
            "dram_budget": int(state_bytes * settings.dram_fraction),
            "profiler": {"enabled": settings.profile, "db": f"sqlite:///{(settings.workdir / 'zinf-profile.db').absolute()}"},
            "placement": {"policy": "adaptive" if settings.adaptive and settings.profile else "static",
                          "replan_every": settings.replan_every},
        },
    }


def run_demo(settings: DemoSettings, console: Console | None = None) -> dict:
    console = console or Console()
    torch.manual_seed(0)
    model, mcfg = build_model("gpt", settings.preset)
    data = TokenBatches(markov_tokens(mcfg.vocab_size, 200_000, seed=0), settings.batch_size, mcfg.block_size, seed=0)
    config = demo_config(model, settings)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]zinf demo[/]: GPT with {n_params / 1e6:.1f} M parameters, training state "
        f"{fmt_bytes(n_params * 20)}, DRAM budget {fmt_bytes(config['zinf']['dram_budget'])}"
    )
    steps_seen = ListRecorder()
    losses: list[float] = []
    t0 = time.perf_counter()
    engine = zinf.initialize(model, config)
    engine.recorder = FanoutRecorder(engine.recorder, steps_seen) if engine.recorder.enabled else steps_seen
    tiers: dict[str, int] = {}
    for p in engine.placement.values():
        tiers[f"param:{p['param']}"] = tiers.get(f"param:{p['param']}", 0) + 1
        tiers[f"optim:{p['optim']}"] = tiers.get(f"optim:{p['optim']}", 0) + 1
    console.print(f"placement: {len(engine.placement)} shards, " + ", ".join(f"{k} {v}" for k, v in sorted(tiers.items()))
                  + f"; O_DIRECT {'on' if engine.o_direct else 'OFF (buffered fallback)'}")
    with engine:
        columns = [TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                   TimeElapsedColumn(), TimeRemainingColumn()]
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("train", total=settings.steps, loss="-")
            for step in range(settings.steps):
                x, y = data.get(step)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                bar.update(task, advance=1, loss=f"{losses[-1]:.3f}")
        ckpt = engine.save_checkpoint(settings.workdir / "zinf-checkpoints")
        controller = engine.controller
        final_tiers: dict[str, int] = {}
        for p in engine.placement.values():
            for state in ("param", "optim"):
                final_tiers[f"{state}:{p[state]}"] = final_tiers.get(f"{state}:{p[state]}", 0) + 1
        traffic = engine.traffic_total
        wall = time.perf_counter() - t0
    steps = steps_seen.of(StepFinished)
    summary = {
        "steps": settings.steps,
        "wall_s": wall,
        "steps_per_s": settings.steps / sum(s.wall_s for s in steps),
        "median_step_s": sorted(s.wall_s for s in steps)[len(steps) // 2],
        "stall_s_per_step": sum(s.stall_s for s in steps) / len(steps),
        "optimizer_s_per_step": sum(s.optimizer_s for s in steps) / len(steps),
        "read_bytes": dict(traffic.read),
        "written_bytes": dict(traffic.written),
        "loss_first": sum(losses[:5]) / min(5, len(losses)),
        "loss_last": sum(losses[-5:]) / min(5, len(losses)),
        "checkpoint": str(ckpt),
        "profile_db": config["zinf"]["profiler"]["db"] if settings.profile else None,
        "plans_made": getattr(controller, "plans_made", 0),
        "plans_adopted": getattr(controller, "plans_adopted", 0),
        "migrations": sum(1 for _ in steps_seen.of(ShardMigrated)),
        "final_placement": final_tiers,
        "last_plan": last_plan_said(controller),
    }
    table = Table(title="zinf demo summary", show_header=False)
    table.add_row("steps/s", f"{summary['steps_per_s']:.2f}  (median step {summary['median_step_s'] * 1e3:.0f} ms)")
    table.add_row("stall per step", f"{summary['stall_s_per_step'] * 1e3:.0f} ms")
    table.add_row("optimizer per step", f"{summary['optimizer_s_per_step'] * 1e3:.0f} ms")
    for tier in ("cpu", "nvme"):
        table.add_row(f"{tier} bytes read / written", f"{fmt_bytes(traffic.read[tier])} / {fmt_bytes(traffic.written[tier])}")
    if controller is not None:
        table.add_row("plans made / adopted", f"{summary['plans_made']} / {summary['plans_adopted']}  (every {settings.replan_every} steps)")
        table.add_row("homes migrated", f"{summary['migrations']}; now " + ", ".join(f"{k} {v}" for k, v in sorted(final_tiers.items())))
        if summary["last_plan"]:  # why the placement is what it is: a user who sees no move learns why
            table.add_row("last plan solved", summary["last_plan"])
    table.add_row("loss (first 5 -> last 5 steps)", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    table.add_row("checkpoint", summary["checkpoint"])
    if settings.profile:
        table.add_row("profile database", summary["profile_db"])
    console.print(table)
    return summary


def last_plan_said(controller) -> str:
    """'adopted: <reason>' or 'kept the placement: <reason>' of the controller's newest solved
    plan (the planner's ``last_decision``); '' without a planner or before its first plan."""
    decision = getattr(controller, "last_decision", None)
    if decision is None:
        return ""
    return f"{'adopted' if decision.adopt else 'kept the placement'}: {decision.reason}"
