"""Saved plans (issue 6, item 4): ``zinf plan`` writes plan.json from a real profile; a new engine
started with ``"zinf": {"placement": {"plan_file": ...}}`` has exactly that placement and trains
as plain PyTorch does (fp32 on the CPU, to 1e-6); bad plan files and CLI misuse are one-line errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import zinf
from zinf.cli import main
from zinf.errors import BudgetError, ConfigError
from zinf.models import build_model

from conftest import gpt_batches
from planner.whatif import WhatIf
from profiler import queries
from test_equivalence import train_plain, train_steps
from test_export import one_error_line
from test_whatif import BATCH, PIN, one_line, profiled_run, tiny_gpt_config

STEPS = 8
TOL = 1e-6


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(profile URL, plan path, plan JSON) of a plan made halfway between all-NVMe and all-DRAM."""
    work = tmp_path_factory.mktemp("planfile")
    url = profiled_run(work)
    wi = WhatIf.from_profile(url)
    budget = (wi.all_nvme_budget_bytes + wi.all_dram_budget_bytes) // 2
    out = work / "plan.json"
    assert main(["plan", "--db", url, "--dram-budget", str(budget), "--out", str(out)]) is None
    return url, out, json.loads(out.read_text())


def engine_config(tmp_path: Path, plan_file, budget: int, pins=PIN) -> dict:
    return tiny_gpt_config(tmp_path, pins, dram_budget=budget, placement={"plan_file": str(plan_file)})


def gpt():
    torch.manual_seed(0)
    return build_model("gpt", "tiny")


def test_plan_file_contents(planned):
    url, out, doc = planned
    assert list(doc) == ["format", "version", "run_id", "dram_budget_bytes", "predicted_step_s", "placement", "created_at"]
    assert doc["format"] == "zinf-plan" and doc["version"] == 1 and doc["run_id"] == queries.latest_run_id(url)
    assert doc["predicted_step_s"] > 0 and doc["created_at"].endswith("Z")
    assert list(doc["placement"]) == queries.shards(url, doc["run_id"])["name"].tolist()
    tiers = [t for v in doc["placement"].values() for t in v.values()]
    assert "cpu" in tiers and "nvme" in tiers, "halfway: some homes in DRAM, some on NVMe"
    for name, t in doc["placement"].items():
        if name.startswith("blocks.0."):
            assert t == {"param": "cpu", "optim": "cpu"}, (name, t)  # the pin kept
    assert not list(out.parent.glob(".plan.json.*")), "no temporary file left"


def test_a_run_started_from_the_plan_has_its_placement_and_trains_like_pytorch(planned, tmp_path):
    url, out, doc = planned
    model, cfg = gpt()
    ref_model, _ = gpt()
    data = gpt_batches(cfg, batch_size=BATCH)
    ref_losses, ref_params = train_plain(ref_model, data, 1, 0.0, STEPS)
    with zinf.initialize(model, engine_config(tmp_path, out, doc["dram_budget_bytes"])) as engine:
        assert engine.placement == doc["placement"]
        losses = train_steps(engine, data, STEPS)
        assert engine.placement == doc["placement"]  # a static run keeps it
        params = engine.state_dict()
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= TOL, name


# ------------------------------------------------------------------------------ bad plan files
def start(tmp_path: Path, doc_or_text, budget: int | None = None, pins=PIN):
    path = tmp_path / "bad.json"
    path.write_text(doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text))
    model, _ = gpt()
    return zinf.initialize(model, engine_config(tmp_path, path, budget or (1 << 30), pins))


def edited(doc: dict, **changes) -> dict:
    out = copy.deepcopy(doc)
    out.update(changes)
    return out


def test_bad_plan_files_are_one_line_errors(planned, tmp_path):
    _, _, doc = planned
    names = list(doc["placement"])
    free = next(n for n, t in doc["placement"].items() if not n.startswith("blocks.0.") and t["optim"] != "none")
    pinned = next(n for n in names if n.startswith("blocks.0."))  # pinned to DRAM (both homes)

    def with_entry(name: str, tiers: dict) -> dict:
        return edited(doc, placement={**doc["placement"], name: tiers})

    cases = [
        ("{not json", "not valid JSON"),
        (edited(doc, format="something-else"), "is not a zinf plan"),
        ([1, 2], "is not a zinf plan"),
        (edited(doc, version=2), "version 2"),
        (edited(doc, placement={}), "no placement"),
        (with_entry("nope.weight", {"param": "cpu", "optim": "cpu"}), "'nope.weight'"),
        (edited(doc, placement={n: t for n, t in doc["placement"].items() if n != names[3]}), repr(names[3])),
        (with_entry(free, {"param": "ssd", "optim": "nvme"}), "'ssd'"),
        (with_entry(free, {"param": "cpu"}), repr(free)),
        (with_entry(free, {"param": "cpu", "optim": "none"}), "no optimizer home"),
        (with_entry(pinned, {"param": "nvme", "optim": "cpu"}), "pins it to 'cpu'"),
    ]
    for content, expect in cases:
        with pytest.raises(ConfigError) as exc:
            start(tmp_path, content)
        msg = one_line(exc)
        assert expect in msg and "zinf.placement.plan_file" in msg, (expect, msg)
    with pytest.raises(ConfigError) as exc:
        model, _ = gpt()
        zinf.initialize(model, engine_config(tmp_path, tmp_path / "missing.json", 1 << 30))
    assert "does not exist" in one_line(exc)
    # the plan must fit the budget of the run that uses it
    with pytest.raises(BudgetError) as exc:
        start(tmp_path, doc, budget=doc["dram_budget_bytes"] // 4)
    msg = one_line(exc)
    assert "plan_file" in msg and "zinf plan --dram-budget" in msg
    assert not (tmp_path / "nvme").exists(), "refused before any swap file was written"


# ------------------------------------------------------------------------------ the CLI
def test_zinf_plan_cli_errors_and_force(planned, tmp_path, capsys):
    url, _, doc = planned
    out = tmp_path / "p.json"
    out.write_text("precious")
    msg = one_error_line(capsys, ["plan", "--db", url, "--dram-budget", "1GiB", "--out", str(out)])
    assert "--force" in msg and out.read_text() == "precious"
    assert "--dram-budget" in one_error_line(capsys, ["plan", "--db", url, "--dram-budget", "lots", "--out", str(tmp_path / "q.json")])
    assert "below" in one_error_line(capsys, ["plan", "--db", url, "--dram-budget", "1KiB", "--out", str(tmp_path / "q.json")])
    assert "unknown run id 99" in one_error_line(capsys, ["plan", "--db", url, "--run", "99", "--dram-budget", "1GiB",
                                                     "--out", str(tmp_path / "q.json")])
    assert "is a directory" in one_error_line(capsys, ["plan", "--db", url, "--dram-budget", "1GiB", "--out", str(tmp_path)])
    assert not (tmp_path / "q.json").exists()
    assert main(["plan", "--db", url, "--dram-budget", "1GiB", "--out", str(out), "--force"]) is None
    printed = capsys.readouterr().out
    assert "predicted" in printed and str(out) in printed
    again = json.loads(out.read_text())
    assert again["dram_budget_bytes"] == 1 << 30 and set(again["placement"]) == set(doc["placement"])
    assert all(t["param"] != "nvme" for t in again["placement"].values()), "1 GiB holds the whole tiny GPT"
