"""What leaving the profiler on costs: step time with per-shard, per-step detail ÷ profiler off.

One command::

    .venv/bin/python benchmarks/profiler_overhead.py --path /work/tmp/povh [--rounds 7] [--steps-per-round 6]

Two engines train the same ``zinf demo`` configuration (built-in GPT, state split between DRAM
and NVMe under a DRAM budget of half the state) side by side in one process: one with the
profiler recording ``detail: shard`` (a row per shard per step, I/O samples, every event) into
a real SQLite file, one with the profiler off. Rounds alternate which engine goes first; each
round trains ``--steps-per-round`` steps on each. The first round is warm-up and not counted.
Printed: the median step time of each, their ratio (the issue's target: <= 1.03), and the
per-round ratios, so the spread caused by the shared disk is visible.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zinf  # noqa: E402
from zinf.demo import DemoSettings, demo_config  # noqa: E402
from zinf.models import build_model  # noqa: E402
from zinf.models.data import TokenBatches, markov_tokens  # noqa: E402
from zinf.storage.fsinfo import filesystem_of  # noqa: E402


def make_engine(work: Path, name: str, profile: bool, preset: str, batch_size: int):
    torch.manual_seed(0)
    model, mcfg = build_model("gpt", preset)
    # the static demo placement on both sides: the adaptive planner would only run on the "on" one
    settings = DemoSettings(workdir=work / name, profile=profile, preset=preset, batch_size=batch_size, adaptive=False)
    (work / name).mkdir()
    config = demo_config(model, settings)
    config["zinf"]["profiler"]["detail"] = "shard"
    engine = zinf.initialize(model, config)
    data = TokenBatches(markov_tokens(mcfg.vocab_size, 200_000, seed=0), batch_size, mcfg.block_size, seed=0)
    return engine, data


def train(engine, data, first_step: int, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` optimizer steps."""
    times = []
    for step in range(first_step, first_step + steps):
        start_s = time.perf_counter()
        x, y = data.get(step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss.item()
        times.append(time.perf_counter() - start_s)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="a directory on the disk to swap to (created if missing)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the first is warm-up")
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--preset", default="demo", help="size of the built-in GPT (tiny, small, demo)")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    if args.rounds < 2:
        sys.exit("error: --rounds must be at least 2 (the first is warm-up)")

    args.path.mkdir(parents=True, exist_ok=True)
    work = args.path / f".profiler-overhead-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    fs = filesystem_of(work)
    print(f"{time.strftime('%Y-%m-%d')} on {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"{fs.fstype} at {args.path}; GPT '{args.preset}', batch {args.batch_size}, DRAM budget 50% of the state")
    try:
        on, on_data = make_engine(work, "on", True, args.preset, args.batch_size)
        off, off_data = make_engine(work, "off", False, args.preset, args.batch_size)
        times = {"on": [], "off": []}
        round_ratios = []
        with on, off:
            for r in range(args.rounds):
                order = [("on", on, on_data), ("off", off, off_data)]
                if r % 2:
                    order.reverse()
                this_round = {}
                for name, engine, data in order:
                    this_round[name] = train(engine, data, r * args.steps_per_round, args.steps_per_round)
                if r == 0:
                    continue  # warm-up: first-step trace recording, file creation, page cache
                for name, t in this_round.items():
                    times[name] += t
                round_ratios.append(statistics.median(this_round["on"]) / statistics.median(this_round["off"]))
                print(f"round {r}/{args.rounds - 1}: profiler on {statistics.median(this_round['on']):.3f} s, "
                      f"off {statistics.median(this_round['off']):.3f} s a step", flush=True)
            dropped = on.recorder.dropped if hasattr(on.recorder, "dropped") else {}
        med_on, med_off = statistics.median(times["on"]), statistics.median(times["off"])
        print()
        print(f"median step: profiler on (detail=shard) {med_on:.3f} s, off {med_off:.3f} s "
              f"over {len(times['on'])} steps each")
        print(f"on / off = {med_on / med_off:.3f}   (per round: {' '.join(f'{x:.3f}' for x in round_ratios)})")
        print(f"recorder dropped: {dropped or 'nothing'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
