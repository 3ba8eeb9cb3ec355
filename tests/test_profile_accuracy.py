"""The recorded profile is true: per-shard, per-step accesses and bytes of a real run equal what the
routing schedule and the placement say they must be.

A fixed-routing MoE (``router="fixed"``: a token's expert is a fixed function of its token id) is
fed, micro-batch by micro-batch, only tokens routed to chosen experts, so the test knows which
experts run. It trains through ``zinf.initialize`` with the profiler on (the real Recorder, a real
SQLite file), with experts and other modules in DRAM and on NVMe, a frozen embedding, a frozen
layer in the middle and gradient accumulation. The truth is computed from the schedule and the
model's structure alone, never from the recorder or the engine's counters:

* an access is one use of a shard by a module that owns one of its parameters: each call of that
  module in forward, and each time autograd runs its backward (a module is reached in backward
  unless its output needs no gradient: a frozen embedding, whose input is token ids);
* a shard gets one optimizer access in a step in which any of its trainable parameters got a
  gradient, none otherwise (idle experts, frozen parameters);
* bytes: a DRAM shard moves nothing to or from NVMe; in the exact case (``exact_bytes``) the NVMe
  bytes follow from the placement, the accesses and the optimizer state (see
  :func:`expected_nvme_bytes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import zinf
from zinf.models import build_model, freeze
from zinf.models.moe import expected_experts, routing_table

from profiler import queries

BATCH, SEQ = 2, 16
ALL = frozenset(range(8))
OPT = {"type": "AdamW", "params": {"lr": 1e-3}}


@dataclass(frozen=True)
class Case:
    accumulation: int
    clipping: float  # > 0 turns updates during backward off (they wait for the global norm)
    reuse_distance: int  # 0: a released param is always freed, every access of an NVMe param reads it
    exact_bytes: bool
    schedule: tuple  # per micro-batch: (experts allowed in layer 0, in layer 1)


CASES = {
    # two micro-batches a step, synchronous optimizer phase: every NVMe byte is predictable
    "accum2_exact_bytes": Case(2, 1.0, 0, True, (
        ({0, 4, 5}, {1, 6, 7}), ({0, 4, 5}, {1, 6, 7}),  # experts 1-3 (DRAM) and 6-7 (NVMe) of layer 0 idle all step
        ({1, 6}, {0, 4}), ({2, 7}, {0, 5}),  # each used in one micro-batch of the two
        (ALL, ALL), ({3, 4}, {2, 3}),
    )),
    # three micro-batches, updates during backward, prefetch keeping params for reuse
    "accum3_overlap": Case(3, 0.0, 1_000_000_000, False, (
        ({0, 4}, {5, 6}), ({0, 4}, {5, 6}), ({1, 5}, {5, 6}),
        (ALL, ALL), ({2, 6}, {0, 1}), ({3, 7}, {0, 1}),
    )),
}


def tokens_for(cfg, allowed0, allowed1, gen) -> torch.Tensor:
    """A (BATCH, SEQ) batch of token ids whose layer-0 expert is in allowed0 and layer-1 expert in allowed1."""
    table = routing_table(cfg)[..., 0]  # (layer, token) -> its expert (top_k = 1)
    pool = [t for t in range(cfg.vocab_size) if int(table[0, t]) in allowed0 and int(table[1, t]) in allowed1]
    assert pool, (allowed0, allowed1)
    return torch.tensor(pool)[torch.randint(len(pool), (BATCH, SEQ), generator=gen)]


def build(tmp_path, case: Case):
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="fixed", block_size=SEQ)
    freeze(model, "wpe.")  # an embedding: no backward at all
    freeze(model, "blocks.1.ln_1.")  # in the middle: backward runs through it, no optimizer
    nvme = str(tmp_path / "nvme")
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": case.accumulation,
        "gradient_clipping": case.clipping,
        "optimizer": OPT,
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": case.reuse_distance,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "module_parameters": {
                "blocks.*.moe.experts[0-3]": {"device": "cpu"}, "blocks.0.attn": {"device": "cpu"}}},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "module_parameters": {
                "blocks.*.moe.experts[0-3]": {"device": "cpu"}, "blocks.1.attn": {"device": "cpu"}}},
        },
        "zinf": {"chunk_size": "64KiB", "shard_min_bytes": "16KiB", "device": "cpu",
                 "profiler": {"enabled": True, "db": f"sqlite:///{tmp_path / 'profile.db'}"}},
    }
    return model, cfg, config


def owners_of(model: nn.Module, shard) -> list[tuple[str, nn.Module]]:
    """The modules that directly own a parameter of ``shard`` (two for the tied wte/lm_head)."""
    ids = {id(m.param) for m in shard.members}
    return [(name, mod) for name, mod in model.named_modules()
            if any(id(p) in ids for p in mod.parameters(recurse=False))]


def forward_calls(module_name: str, used: dict[int, set[int]]) -> int:
    """Calls of a module in one forward: an expert runs only when it got a token."""
    m = re.match(r"blocks\.(\d+)\.moe\.experts\.(\d+)\.", module_name + ".")
    return int(int(m[2]) in used[int(m[1])]) if m else 1


def reached_in_backward(module: nn.Module) -> bool:
    own = list(module.parameters(recurse=False))
    return any(p.requires_grad for p in own) or not isinstance(module, nn.Embedding)


def expected_nvme_bytes(shard, place, fwd: list[int], bwd: list[int], updated_before: bool):
    """(read, written) NVMe bytes of one shard in one step of the exact case: fp32 on the CPU,
    param and optimizer files in one store, no reuse of released params, no updates during
    backward. ``fwd``/``bwd``: accesses per micro-batch; ``updated_before``: the shard has Adam
    moments from an earlier step.

    * param home on NVMe: a one-parameter shard is read at every access; a chunk of several
      (held for the whole pass once fetched) once per micro-batch that uses it;
    * optimizer home on NVMe: the gradient is written after every micro-batch that produced one,
      and read back before adding the next; the update reads master (+ both moments once they
      exist) + gradient and writes master + both moments;
    * param home on NVMe with the optimizer in DRAM: the update rewrites the param file (with
      both on NVMe in fp32 the master file *is* the param file).
    """
    n4 = shard.numel * 4  # fp32 bytes of one state
    chunk = len(shard.members) > 1
    read = written = 0
    if place["param"] == "nvme":
        read += sum(int(f > 0) * n4 if chunk else (f + b) * n4 for f, b in zip(fwd, bwd))
    grads = [b > 0 and shard.trainable for b in bwd]
    if place["optim"] == "nvme" and any(grads):
        seen = False
        for g in grads:
            if g:
                read += n4 if seen else 0  # the sum so far, back from NVMe
                written += n4
                seen = True
        read += n4 * (1 + (2 if updated_before else 0) + 1)  # master, moments, gradient
        written += n4 * 3
    if place["param"] == "nvme" and place["optim"] == "cpu" and any(grads):
        written += n4
    return read, written


@pytest.mark.parametrize("name", list(CASES))
def test_recorded_accesses_and_bytes_match_the_schedule(tmp_path, name):
    case = CASES[name]
    model, cfg, config = build(tmp_path, case)
    k = case.accumulation
    n_steps = len(case.schedule) // k
    gen = torch.Generator().manual_seed(1)
    losses: list[list[float]] = []
    used: list[list[dict[int, set[int]]]] = []  # [step][micro-batch] layer -> experts that got tokens
    with zinf.initialize(model, config) as engine:
        shards = engine.shards
        placement = engine.placement
        for s in range(n_steps):
            losses.append([])
            used.append([])
            for j in range(k):
                x = tokens_for(cfg, *case.schedule[s * k + j], gen)
                used[s].append(expected_experts(cfg, x))
                loss = engine(x, torch.roll(x, -1, dims=1))
                losses[s].append(float(loss.detach()))
                engine.backward(loss)
                engine.step()
        url = config["zinf"]["profiler"]["db"]
        run_id = engine.recorder.wait_run_id(10)
    assert engine.global_steps == n_steps

    # the schedule does what the cases promise: idle experts, in both tiers, and partial use
    idle0 = set(range(8)) - set().union(*(u[0] for u in used[0]))
    assert idle0 & {0, 1, 2, 3} and idle0 & {4, 5, 6, 7}, idle0
    assert any(len({e in u[0] for u in used[s]}) == 2 for s in range(n_steps) for e in range(8))

    # ------------------------------------------------------------------- the truth
    truth: dict[tuple[int, str], dict] = {}  # (recorded step, shard) -> expected row
    updated: set[str] = set()
    for s in range(n_steps):
        for sh in shards:
            owners = owners_of(model, sh)
            fwd = [sum(forward_calls(n, u) for n, _ in owners) for u in used[s]]
            bwd = [sum(forward_calls(n, u) for n, mod in owners if reached_in_backward(mod)) for u in used[s]]
            opt = int(sh.trainable and sum(bwd) > 0)
            row = {"forward_accesses": sum(fwd), "backward_accesses": sum(bwd), "recompute_accesses": 0,
                   "optimizer_accesses": opt}
            if case.exact_bytes:
                row["read_nvme_bytes"], row["written_nvme_bytes"] = expected_nvme_bytes(
                    sh, placement[sh.name], fwd, bwd, sh.name in updated)
            if opt:
                updated.add(sh.name)
            truth[(s + 1, sh.name)] = row

    # ------------------------------------------------------------------- what was recorded
    info = queries.run_info(url, run_id)
    assert info["status"] == "finished" and info["dropped_events"] == {}
    rec_shards = queries.shards(url, run_id).set_index("name")
    assert list(rec_shards.index) == [sh.name for sh in shards]
    for sh in shards:
        r = rec_shards.loc[sh.name]
        assert (r["kind"], int(r["numel"]), r["param_tier"], r["optim_tier"]) == (
            sh.kind, sh.numel, placement[sh.name]["param"], placement[sh.name]["optim"]), sh.name
        assert list(r["members"]) == [n for m in sh.members for n in m.names]
        assert int(r["grad_bytes"]) == (sh.numel * 4 if sh.trainable else 0)
    kinds = set(rec_shards["kind"])
    assert {"expert", "frozen", "chunk", "param", "embedding"} <= kinds

    rows = queries.shard_steps(url, run_id)
    assert set(rows["window_steps"]) == {1}
    got = rows.set_index(["step", "name"])
    cols = ["forward_accesses", "backward_accesses", "recompute_accesses", "optimizer_accesses",
            "read_nvme_bytes", "written_nvme_bytes", "read_cpu_bytes", "written_cpu_bytes"]
    mismatches = []
    for (step, shard), want in truth.items():
        have = got.loc[(step, shard), cols].to_dict() if (step, shard) in got.index else dict.fromkeys(cols, 0)
        have = {c: int(v) for c, v in have.items()}
        for c, v in want.items():
            if have[c] != v:
                mismatches.append(f"step {step} {shard} {c}: recorded {have[c]}, truth {v}")
        place = placement[shard]
        # placement consistency, in every case
        if place["param"] != "nvme" and place["optim"] != "nvme":
            if have["read_nvme_bytes"] or have["written_nvme_bytes"]:
                mismatches.append(f"step {step} {shard}: a DRAM shard moved NVMe bytes {have}")
        n4 = next(sh.numel for sh in shards if sh.name == shard) * 4
        if place["param"] == "nvme" and want["forward_accesses"] and have["read_nvme_bytes"] < n4:
            mismatches.append(f"step {step} {shard}: an NVMe param used in forward read {have['read_nvme_bytes']} B")
        if place["optim"] == "nvme" and want["optimizer_accesses"] and (
                have["read_nvme_bytes"] < n4 or have["written_nvme_bytes"] < 3 * n4):
            mismatches.append(f"step {step} {shard}: an NVMe optimizer update moved too little {have}")
        if (step, shard) in got.index:  # tiers at the end of the step: where it lives
            r = got.loc[(step, shard)]
            if (r["param_tier"], r["optim_tier"]) != (place["param"], place["optim"]):
                mismatches.append(f"step {step} {shard}: tiers {(r['param_tier'], r['optim_tier'])}, placed {place}")
    assert not mismatches, "\n".join(mismatches[:40]) + f"\n({len(mismatches)} in all)"
    # rows only for shards accessed in a step: an idle expert has none (0 accesses), and no row is extra
    accessed = {key for key, want in truth.items() if any(want[c] for c in cols[:4])}
    assert set(got.index) == accessed

    # the parameters of dense modules: k forward accesses per optimizer step (one call per micro-batch)
    dense = "blocks.0.attn.c_attn.weight"
    assert [int(got.loc[(s + 1, dense), "forward_accesses"]) for s in range(n_steps)] == [k] * n_steps
    # idle experts: no row at all in the step, so the query API reports 0
    stats = queries.shard_access_stats(url, run_id, first_step=1, last_step=1).set_index("name")
    for e in idle0:
        for part in ("c_fc", "c_proj"):
            w = f"blocks.0.moe.experts.{e}.{part}.weight"
            assert stats.loc[w, "forward_accesses"] == stats.loc[w, "optimizer_accesses"] == 0
    frozen = [sh.name for sh in shards if not sh.trainable]
    assert len(frozen) == 2 and (rows[rows["name"].isin(frozen)]["optimizer_accesses"] == 0).all()
    wpe, ln = (next(n for n in frozen if key in n) for key in ("wpe.", "blocks.1.ln_1."))
    assert (got.xs(wpe, level="name")["backward_accesses"] == 0).all()  # nothing to do in backward
    mid = got.xs(ln, level="name")  # backward runs through it to the layers below
    assert (mid["backward_accesses"] == mid["forward_accesses"]).all() and (mid["forward_accesses"] == k).all()

    # steps: one row per optimizer step, its bytes the sum of its shards' bytes, its loss the mean
    steps = queries.steps(url, run_id)
    assert steps["step"].tolist() == list(range(1, n_steps + 1))
    assert set(steps["micro_batches"]) == {k}
    assert steps["loss"].tolist() == pytest.approx([sum(ls) / k for ls in losses], rel=1e-6)
    per_step = rows.groupby("step")[["read_nvme_bytes", "written_nvme_bytes", "read_cpu_bytes"]].sum()
    for c in ("read_nvme_bytes", "written_nvme_bytes", "read_cpu_bytes"):
        assert steps.set_index("step")[c].tolist() == per_step[c].tolist(), c
    assert (steps["read_nvme_bytes"] > 0).all() and (steps["written_nvme_bytes"] > 0).all()
    assert (steps["dram_bytes"] > 0).all() and (steps["rss_bytes"] > 0).all()
    assert (steps["wall_s"] >= steps["forward_s"] + steps["backward_s"]).all()
    assert set(steps["gpu_bytes"]) == {0} and set(steps["pinned_bytes"]) == {0}  # a CPU run

    # the run's measured bandwidths: every NVMe request of the run, subsampled or not
    io = queries.io_samples(url, run_id)
    bw = info["bandwidths"]
    for op in ("read", "write"):
        part = io[io["op"] == op]
        assert bw[f"nvme_{op}_bytes"] == int(part["bytes"].sum()) > 0
        assert bw[f"nvme_{op}_GBps"] == pytest.approx(part["bytes"].sum() / part["seconds"].sum() / 1e9)
