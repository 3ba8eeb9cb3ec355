"""Response time of every dashboard page and API route on a profile with 10^6 shard-step rows.

One command::

    .venv/bin/python benchmarks/dashboard_latency.py [--db PATH] [--rebuild] [--shards 1000]
        [--steps 1000] [-n 10] [--routes SUBSTRING] [--json FILE]

**The database** (``--db``, default ``/tmp/zinf-dashboard-bench/profile.db``; kept and reused
while its row counts match, ``--rebuild`` makes it again, ~30 s) is created by the real schema
migrations (:func:`profiler.store.upgrade`) and filled with SQLAlchemy Core bulk inserts into the
real tables. Its rows are synthetic - made here with a seeded RNG, not recorded by a training run -
but shaped like the rows the recorder writes for a profiled MoE (``tests/test_dashboard_api.py``'s
run 2, scaled up):

* one finished run (adaptive policy, ``detail: shard``, 2 GiB DRAM budget) of ``--steps`` optimizer
  steps of ~1.2 s, with loss, bytes per tier, memory and the plan version in force;
* ``--shards`` shards: an embedding, 9 packed chunks, and per transformer block 3 dense
  weights and 48 experts x 2 weights (4 MiB of fp32 param each; Adam state 3x, gradient 1x);
* ``shards x steps`` ``shard_steps`` rows (10^6 by default, one per shard and step): dense
  weights used every step, each block's experts routed by a Zipf law that drifts over the run;
  bytes read from the param home's tier, optimizer read/write, fetch and stall seconds;
* ~20 ``io_samples`` a step (reads and writes of params, masters and moments at ~1.5 GB/s);
* a plan every 100 steps (``--shards`` assignments each), 60% adopted, each adopted plan
  migrating ~40 homes NVMe -> DRAM or back.

**The server** is the real one: ``zinf dashboard --db URL --port P`` in a subprocess (uvicorn),
asked over HTTP by httpx from this process. For every route a fresh server is started, so that
its first call is cold (nothing cached in the app; the database file is in the OS page cache, as
it is on a machine that just wrote it), then the same request is made ``-n`` more times: the table
shows the cold call and the median (and max) of the repeats, and PASS when the median is under
500 ms (the target of issue 6). ``what-if (slider)`` asks a new budget each time (no cache),
as a user dragging the slider does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from profiler import schema, store  # noqa: E402
from zinf.config import load_config  # noqa: E402

TARGET_S = 0.5  # median response time target (issue 6)
RUN = 1
MiB = 1 << 20
EXPERTS = 48  # per block, each with two weights (c_fc, c_proj)
PER_BLOCK = 3 + 2 * EXPERTS  # attn.c_attn, attn.c_proj, moe.gate + experts
IO_PER_STEP = 20
PLAN_EVERY = 100  # steps
BATCH = 100_000  # rows per executemany


# ------------------------------------------------------------------------------ the database
def shard_rows(n_shards: int) -> list[dict]:
    """Shards in model order: wte, 9 packed chunks, then blocks of PER_BLOCK weights."""
    rows: list[dict] = []

    def add(name: str, module: str, kind: str, numel: int) -> None:
        param = 4 * numel  # fp32
        rows.append({"id": len(rows) + 1, "run_id": RUN, "shard_index": len(rows), "name": name, "module": module,
                     "kind": kind, "numel": numel, "param_bytes": param, "optim_bytes": 3 * param, "grad_bytes": param,
                     "members": json.dumps([name]), "param_tier": "nvme", "optim_tier": "nvme"})

    add("wte.weight", "wte", "embedding", 8 * MiB // 4)
    for i in range(9):
        members = [f"blocks.{i}.ln_1.weight", f"blocks.{i}.ln_2.weight"]
        add(f"chunk{i}:{members[0]}", f"blocks.{i}", "chunk", 64 * 1024)
        rows[-1]["members"] = json.dumps(members)
    block = 0
    while len(rows) < n_shards:
        b = f"blocks.{block}"
        for w in ("attn.c_attn", "attn.c_proj", "moe.gate"):
            add(f"{b}.{w}.weight", f"{b}.{w}", "param", MiB)
        for e in range(EXPERTS):
            for w in ("c_fc", "c_proj"):
                add(f"{b}.moe.experts.{e}.{w}.weight", f"{b}.moe.experts.{e}.{w}", "expert", MiB)
        block += 1
    return rows[:n_shards]


def run_row(n_shards: int, n_steps: int, shards: list[dict], t0: float, nvme: str) -> dict:
    config = load_config({
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "zinf": {"dram_budget": "2GiB", "placement": {"policy": "adaptive"},
                 "profiler": {"enabled": True, "detail": "shard"}},
    }).to_dict()
    state = sum(s["param_bytes"] + s["optim_bytes"] + s["grad_bytes"] for s in shards)
    params = sum(s["numel"] for s in shards)
    return {
        "id": RUN, "name": "bench-moe-1000x1000", "status": "finished", "started_at": t0,
        "finished_at": t0 + 1.2 * n_steps, "last_heartbeat": t0 + 1.2 * n_steps, "config": config,
        "model": {"class": "MoETransformer", "params": params, "trainable_params": params, "shards": n_shards,
                  "state_bytes": state},
        "hardware": {"cpu": "synthetic (benchmarks/dashboard_latency.py)", "cores": 16, "dram_bytes": 128 << 30,
                     "torch": "none", "gpu": None, "gpu_bytes": 0},
        "bandwidths": {"nvme_read_GBps": 1.6, "nvme_write_GBps": 1.1},
        "swap_dir": nvme, "o_direct": True, "hostname": "bench", "pid": None, "detail": "shard", "window_steps": 1,
        "dropped_events": {},
    }


def build_database(path: Path, n_shards: int, n_steps: int) -> None:
    """Create ``path`` at the schema's head revision and bulk-insert the synthetic profile."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{path}"
    store.upgrade(url)
    rng = np.random.default_rng(0)
    t0 = 1_796_000_000.0  # epoch seconds
    shards = shard_rows(n_shards)
    kinds = np.array([s["kind"] for s in shards])
    pbytes = np.array([s["param_bytes"] for s in shards], dtype=np.int64)
    expert = kinds == "expert"
    block_of = np.array([int(s["name"].split(".")[1]) if s["name"].startswith("blocks.") else -1 for s in shards])

    # homes over the run: plans move homes between NVMe and DRAM; shard_steps record the tiers in force
    param_tier = np.array(["nvme"] * n_shards, dtype=object)
    optim_tier = param_tier.copy()
    plans, assignments, migrations = [], [], []
    plan_at: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    version = 0
    for created in range(PLAN_EVERY, n_steps, PLAN_EVERY):
        adopted = rng.random() < 0.6
        new_p, new_o = param_tier.copy(), optim_tier.copy()
        if adopted:
            version += 1
            moved = rng.choice(n_shards, size=40, replace=False)
            for i in moved:
                state = "param" if rng.random() < 0.7 else "optim"
                tiers = new_p if state == "param" else new_o
                src, dst = tiers[i], ("cpu" if tiers[i] == "nvme" else "nvme")
                tiers[i] = dst
                nbytes = int(pbytes[i] if state == "param" else 3 * pbytes[i])
                migrations.append({"run_id": RUN, "step": created, "plan_version": version, "shard_id": i + 1,
                                   "state": state, "src_tier": src, "dst_tier": dst, "bytes": nbytes,
                                   "seconds": nbytes / 1.2e9})
            plan_at[created] = (new_p, new_o)
            param_tier, optim_tier = new_p, new_o
        plan_id = len(plans) + 1
        plans.append({"id": plan_id, "run_id": RUN, "version": version if adopted else version + 1, "created_step": created,
                      "created_at": t0 + 1.2 * created, "policy": "adaptive", "dram_budget_bytes": 2 << 30,
                      "predicted_step_s": 1.1 - 0.01 * version, "predicted_gain_s": 0.02, "adopted": adopted,
                      "reason": {"adopt": adopted, "why": "synthetic", "moves": 40 if adopted else 0}})
        for i in range(n_shards):
            assignments.append({"plan_id": plan_id, "shard_id": i + 1, "param_tier": new_p[i], "optim_tier": new_o[i],
                                "score": float(rng.random())})

    steps, io = [], []
    wall = 1.1 + 0.1 * rng.standard_normal(n_steps).clip(-2, 2)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(schema.runs.insert(), [run_row(n_shards, n_steps, shards, t0, str(path.parent / "nvme"))])
        conn.execute(schema.shards.insert(), shards)
        conn.execute(schema.plans.insert(), plans)
        for k in range(0, len(assignments), BATCH):
            conn.execute(schema.plan_assignments.insert(), assignments[k:k + BATCH])
        if migrations:
            conn.execute(schema.migrations.insert(), migrations)

    # shard_steps and steps, step by step (tiers follow the plans adopted so far)
    p_tier, o_tier = np.array(["nvme"] * n_shards, dtype=object), np.array(["nvme"] * n_shards, dtype=object)
    version, pending = 0, []
    ranks = np.arange(1, EXPERTS + 1)
    zipf = 1.0 / ranks ** 1.1
    zipf /= zipf.sum()
    n_blocks = int(block_of.max()) + 1
    with engine.begin() as conn:
        for s in range(1, n_steps + 1):
            if s - 1 in plan_at:
                p_tier, o_tier = plan_at[s - 1]
                version += 1
            # experts routed by a Zipf law whose ranking drifts: 8 tokens x top-2 per block, per step
            used = ~expert.copy()
            for b in range(n_blocks):
                perm = np.roll(np.arange(EXPERTS), (s // 200) + b)
                chosen = rng.choice(EXPERTS, size=4, replace=False, p=zipf)
                for e in perm[chosen]:
                    first = np.flatnonzero((block_of == b) & expert)[0] + 2 * e
                    used[first:first + 2] = True
            fwd = used.astype(np.int64)
            nvme_p = p_tier == "nvme"
            read_nvme = np.where(used & nvme_p, pbytes, 0) + np.where(o_tier == "nvme", 3 * pbytes, 0) * used
            read_cpu = np.where(used & ~nvme_p, pbytes, 0)
            fetch = np.where(used, pbytes / np.where(nvme_p, 1.5e9, 8e9), 0.0)
            stall = fetch * rng.uniform(0, 0.6, n_shards)
            opt_s = np.where(used, pbytes * 4 / 2e9, 0.0)
            for i in range(n_shards):
                pending.append({
                    "run_id": RUN, "step": s, "window_steps": 1, "shard_id": i + 1, "forward_accesses": int(fwd[i]),
                    "backward_accesses": int(fwd[i]), "recompute_accesses": 0, "optimizer_accesses": int(fwd[i]),
                    "read_cpu_bytes": int(read_cpu[i]), "read_nvme_bytes": int(read_nvme[i]),
                    "written_nvme_bytes": int(read_nvme[i]), "fetch_s": float(fetch[i]), "stall_s": float(stall[i]),
                    "optimizer_s": float(opt_s[i]), "param_tier": p_tier[i], "optim_tier": o_tier[i]})
            stall_s = float(stall.sum()) * 0.2
            steps.append({
                "run_id": RUN, "step": s, "recorded_at": t0 + 1.2 * s, "micro_batches": 1, "wall_s": float(wall[s - 1]),
                "forward_s": 0.3, "backward_s": 0.45, "optimizer_s": 0.25, "stall_s": stall_s,
                "migration_s": 0.3 if s - 1 in plan_at else 0.0, "loss": float(6.0 * np.exp(-s / 400) + 2.5 + 0.05 * rng.standard_normal()),
                "read_cpu_bytes": int(read_cpu.sum()), "read_nvme_bytes": int(read_nvme.sum()),
                "written_nvme_bytes": int(read_nvme.sum()), "dram_bytes": int((~nvme_p * pbytes).sum()) + (256 << 20),
                "pinned_bytes": 64 << 20, "gpu_bytes": 0, "rss_bytes": 3 << 30, "plan_version": version})
            for _ in range(IO_PER_STEP):
                i = int(rng.integers(n_shards))
                what = ["param", "master", "exp_avg", "exp_avg_sq"][int(rng.integers(4))]
                nbytes = int(pbytes[i])
                io.append({"run_id": RUN, "step": s, "shard_id": i + 1, "op": "read" if rng.random() < 0.6 else "write",
                           "tier": "nvme", "what": what, "bytes": nbytes, "seconds": 60e-6 + nbytes / 1.5e9 * rng.uniform(0.8, 1.4),
                           "o_direct": True, "block_size": MiB, "queue_depth": 8, "thread_count": 4,
                           "concurrency": float(rng.uniform(1, 4))})
            if len(pending) >= BATCH:
                conn.execute(schema.shard_steps.insert(), pending)
                pending = []
        if pending:
            conn.execute(schema.shard_steps.insert(), pending)
        conn.execute(schema.steps.insert(), steps)
        conn.execute(schema.io_samples.insert(), io)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")  # no ANALYZE: the recorder runs none either
    engine.dispose()


def counts(path: Path) -> dict[str, int]:
    engine = sa.create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
    try:
        with engine.connect() as conn:
            return {t: int(conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar()) for t in
                    ("shards", "steps", "shard_steps", "io_samples", "plans", "plan_assignments", "migrations")}
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``zinf dashboard`` in a subprocess, on a free port of 127.0.0.1."""

    def __init__(self, url: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", "from zinf.cli import main; main()", "dashboard",
                                      "--db", url, "--port", str(self.port)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:  # ready when it answers the favicon (a route not measured, and that reads nothing)
            if self.proc.poll() is not None:
                raise RuntimeError(f"zinf dashboard exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.base + "/favicon.ico", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("zinf dashboard did not start in 60 s")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def routes(path: Path) -> list[tuple[str, str]]:
    """(label, path) of every page and API route, with realistic arguments."""
    engine = sa.create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
    with engine.connect() as conn:
        plan_id = conn.exec_driver_sql("SELECT min(id) FROM plans WHERE adopted").scalar()
        last = conn.exec_driver_sql(f"SELECT max(step) FROM steps WHERE run_id = {RUN}").scalar()
    engine.dispose()
    r = f"/runs/{RUN}"
    a = f"/api/runs/{RUN}"
    out = [("page /", "/"), ("page overview", r), ("page shards", r + "/shards"), ("page plans", r + "/plans"),
           ("page what-if", r + "/what-if"), ("static plotly.min.js", "/static/plotly.min.js"),
           ("static dashboard.js", "/static/dashboard.js"), ("openapi.json", "/openapi.json"),
           ("api runs", "/api/runs"), ("api run", a), ("api steps (first 1000)", a + "/steps"),
           ("api steps (live poll)", f"{a}/steps?after_step={last - 5}"),
           ("api shards (hottest 50)", a + "/shards?limit=50"),
           ("api shards (by name, page 11)", a + "/shards?limit=50&sort=name&order=asc&offset=500"),
           ("api shard-heatmap", a + "/shard-heatmap"),
           ("api io-samples", a + "/io-samples?limit=100"), ("api io-samples (offset 10^4)", a + "/io-samples?limit=100&offset=10000"),
           ("api plans", a + "/plans"), ("api migrations", a + "/migrations"),
           ("api plan", f"/api/plans/{plan_id}"), ("api plan assignments", f"/api/plans/{plan_id}/assignments?limit=100")]
    names = ["step-time", "loss", "bandwidth", "memory", "bytes-moved", "shard-heatmap", "shard-treemap",
             "migrations", "predicted-vs-measured", "cost-model"]
    out += [(f"api figure {n}", f"{a}/figures/{n}") for n in names]
    out += [("api what-if", a + "/what-if"), ("api what-if?budget", a + "/what-if?budget=3000000000"),
            ("api what-if (slider)", a + "/what-if?budget={budget}")]
    return out


def measure(base: str, path: str, n: int) -> tuple[float, list[float], int]:
    """The cold first call and ``n`` repeats, seconds; and the body size of the last, bytes (as
    sent before gzip, which the app applies above 4 kB).
    ``{budget}`` in the path: a different budget every call (the slider, uncached)."""
    times, size = [], 0
    with httpx.Client(base_url=base, timeout=600) as client:
        for k in range(n + 1):
            p = path.format(budget=2_000_000_000 + 7_654_321 * (k + 1)) if "{budget}" in path else path
            t = time.perf_counter()
            resp = client.get(p, headers={"Accept-Encoding": "gzip"})
            times.append(time.perf_counter() - t)
            if resp.status_code != 200:
                raise RuntimeError(f"{p}: HTTP {resp.status_code}: {resp.text[:300]}")
            size = len(resp.content)
    return times[0], times[1:], size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", type=Path, default=Path("/tmp/zinf-dashboard-bench/profile.db"))
    ap.add_argument("--rebuild", action="store_true", help="make the database again even if it looks complete")
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("-n", type=int, default=10, help="repeats after the cold call")
    ap.add_argument("--routes", default="", help="only routes whose label contains this")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    want = {"shards": args.shards, "steps": args.steps, "shard_steps": args.shards * args.steps}
    have = counts(args.db) if args.db.exists() else {}
    if args.rebuild or any(have.get(k) != v for k, v in want.items()):
        t = time.perf_counter()
        build_database(args.db, args.shards, args.steps)
        print(f"built {args.db} in {time.perf_counter() - t:.1f} s", flush=True)
        have = counts(args.db)
    url = f"sqlite:///{args.db}"
    size_mb = args.db.stat().st_size / 1e6
    print(f"# dashboard latency, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()} "
          f"({os.cpu_count()} cores), python {platform.python_version()}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"# database {args.db} ({size_mb:.0f} MB): " + ", ".join(f"{k} {v:,}" for k, v in have.items()))
    print(f"# each route on a fresh `zinf dashboard` server: the first (cold) call, then {args.n} repeats; "
          f"PASS: median < {TARGET_S * 1000:.0f} ms")
    print(f"{'route':34s} {'cold ms':>9s} {'median ms':>10s} {'max ms':>8s} {'body kB':>8s}  result")
    results = []
    for label, path in routes(args.db):
        if args.routes and args.routes not in label:
            continue
        server = Server(url)
        try:
            cold, rest, size = measure(server.base, path, args.n)
        finally:
            server.close()
        med = statistics.median(rest)
        ok = med < TARGET_S
        results.append({"route": label, "path": path, "cold_s": cold, "median_s": med, "max_s": max(rest),
                        "bytes": size, "pass": ok})
        print(f"{label:34s} {cold * 1000:9.0f} {med * 1000:10.1f} {max(rest) * 1000:8.0f} {size / 1e3:8.0f}  "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
    passed = sum(r["pass"] for r in results)
    print(f"# {passed} of {len(results)} routes PASS (median < {TARGET_S * 1000:.0f} ms); slowest cold call "
          f"{max(r['cold_s'] for r in results) * 1000:.0f} ms ({max(results, key=lambda r: r['cold_s'])['route']})")
    if args.json:
        args.json.write_text(json.dumps({"database": have, "results": results}, indent=2) + "\n")
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
