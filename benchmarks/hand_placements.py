"""Hand-made placements of the skewed MoE against all-NVMe, in one process: does a placement by
routing probability alone beat what the planner picks?

Each placement fills the DRAM budget greedily in one order, a home moving to DRAM when the engine
still accepts the budget (``planner_policies.fits_budget``), and runs from a plan file
(``zinf.placement.plan_file``) with the overlap buffers the engine sizes in what is left:

* ``params_all_then_optim``: every param home first, then optimizer homes by hit probability;
* ``both_by_p``: experts by hit probability, optimizer home then param home;
* ``optim_by_p_then_params``: optimizer homes by hit probability, then param homes.

The hit probability of an expert is the fraction of 300 batches of the benchmark's data that
route at least one token to it. Prints the median step (seconds) and NVMe MB a step of each,
round after round, beside the ``nvme`` policy.

    OMP_NUM_THREADS=8 python3 benchmarks/hand_placements.py --path /tmp/hp --device cuda
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_policies as pp  # noqa: E402

import zinf  # noqa: E402
from zinf.planfile import plan_document  # noqa: E402


def hit_probability(w: pp.Workload, name: str, load) -> float:
    """P(an expert gets a token in a step) for an expert's shard; 1 for the dense chunk."""
    if ".experts." not in name:
        return 1.0
    parts = name.split(".")  # blocks.<layer>.moe.experts.<expert>.<matrix>.weight
    return float(load[int(parts[1]), int(parts[4])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="swap files and plan files go under it (removed at the end)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--budget", type=float, default=0.3, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    pp.DEVICE = args.device
    root = args.path
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    w = pp.make_workload("moe", False)
    budget = int(args.budget * w.state_bytes)
    load = sum(pp.expert_load(w.model.config, w.data.get(i)[0]) > 0 for i in range(300)).float() / 300
    with zinf.initialize(copy.deepcopy(w.model), pp.policy_config(w, "nvme", root / "names", budget)) as e:
        names = list(e.placement)
    p_of = {n: hit_probability(w, n, load) for n in names}

    def config_for(place: dict, tag: str) -> dict:
        plan = root / f"{tag}.json"
        plan.write_text(json.dumps(plan_document(run_id=0, dram_budget_bytes=budget, predicted_step_s=0.0,
                                                 placement=place, created_at="hand-made")))
        cfg = pp.policy_config(w, "nvme", root / tag, budget)
        cfg["zinf"]["placement"] = {"plan_file": str(plan)}
        return cfg

    def greedy(order: list[tuple[str, str]]) -> dict:
        place = {n: {"param": "nvme", "optim": "nvme"} for n in names}
        for name, what in order:
            place[name][what] = "cpu"
            if not pp.fits_budget(w.model, config_for(place, "probe")):
                place[name][what] = "nvme"
        return place

    by_p = sorted(names, key=lambda n: -p_of[n])
    variants = {
        "params_all_then_optim": greedy([(n, "param") for n in by_p] + [(n, "optim") for n in by_p]),
        "both_by_p": greedy([(n, x) for n in by_p for x in ("optim", "param")]),
        "optim_by_p_then_params": greedy([(n, "optim") for n in by_p] + [(n, "param") for n in by_p]),
    }
    hit_per_step = float(load.sum())
    for tag, place in variants.items():
        dram = {x: [n for n, v in place.items() if v[x] == "cpu"] for x in ("param", "optim")}
        hits = {x: sum(p_of[n] for n in dram[x] if ".experts." in n) / 2 for x in dram}  # two shards an expert
        print(f"{tag}: {len(dram['param'])}+{len(dram['optim'])}/{len(place)} DRAM homes; experts hit a step with "
              f"a DRAM param home {hits['param']:.1f}, a DRAM optimizer home {hits['optim']:.1f} "
              f"(of {hit_per_step:.1f} experts hit a step)", flush=True)

    def run(cfg: dict) -> tuple[float, float]:
        steps, nvme_mb = [], []
        with zinf.initialize(copy.deepcopy(w.model), cfg) as eng:
            def nvme_bytes() -> int:  # traffic_total is updated in place: read its numbers now
                return eng.traffic_total.read["nvme"] + eng.traffic_total.written["nvme"]

            for s in range(args.warmup + args.steps):
                before = nvme_bytes()
                x, y = w.data.get(s)
                eng.backward(eng(x, y))
                eng.step()
                if s >= args.warmup:
                    steps.append(eng.last_step["wall_s"])
                    nvme_mb.append((nvme_bytes() - before) / 1e6)
        return statistics.median(steps), statistics.median(nvme_mb)

    for rnd in range(args.rounds):
        runs = [("nvme", pp.policy_config(w, "nvme", root / "nvme", budget))]
        runs += [(tag, config_for(place, tag)) for tag, place in variants.items()]
        for tag, cfg in runs:
            step_s, mb = run(cfg)
            print(f"round {rnd} {tag:<24} step {step_s:.3f} s  NVMe {mb:.1f} MB/step", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
