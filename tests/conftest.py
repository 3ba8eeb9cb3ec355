"""Shared fixtures: small models, deterministic data, and placements to run them in."""

from __future__ import annotations

import copy

import pytest
import torch

from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

# Small shard sizes so that tiny models still have both own-shard parameters and packed chunks.
SMALL_SHARDS = {"chunk_size": "64KiB", "shard_min_bytes": "16KiB"}


def placement_config(kind: str, tmp_path, model=None) -> dict:
    """A zinf config dict for one of the placements the equivalence tests cover."""
    nvme = str(tmp_path / "nvme")
    zero: dict = {"stage": 3}
    extra: dict = {}  # zinf settings beyond the small shards and the CPU device
    if kind == "dram":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    elif kind == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    elif kind == "max_in_cpu":
        half = sum(p.numel() for p in model.parameters()) // 2
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": half}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    elif kind == "pins":  # the seed article's shape: first layers in DRAM, the rest on NVMe
        zero["offload_params"] = {
            "device": "nvme",
            "nvme_path": nvme,
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "module_parameters": {"blocks[0]": {"device": "cpu"}, "blocks[1-]": {"device": "nvme"}},
        }
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    elif kind == "adaptive":
        # all on NVMe at the start, and the planner moves homes into DRAM while training runs:
        # every 4 steps, adopting any predicted gain (no margins, no reverts). No param prefetch
        # window: every NVMe param read is then a stall a DRAM home saves, so that plans are
        # adopted and homes really migrate (with a window the model may keep all on NVMe).
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        zero["stage3_prefetch_bucket_size"] = 0
        numel = sum(p.numel() for p in model.parameters())
        placement = {"policy": "adaptive", "replan_every": 4, "plan_lag_steps": 0, "adopt_margin": 0,
                     "min_gain_fraction": 0, "revert_fraction": None, "trial_band": 0}
        # room for the working set and 2 MiB of staging, and for homes of ~40% of the state
        extra = dict(staging_buffer_size="1MiB", staging_buffers=2, dram_budget=(4 << 20) + 8 * numel,
                    placement=placement, profiler={"db": f"sqlite:///{tmp_path}/profile.db"})
    else:
        raise ValueError(kind)
    # the CPU is the compute device of these tests, also on a machine with a GPU (tests/test_gpu.py
    # runs the same cases on CUDA)
    return {"zero_optimization": zero, "zinf": dict(SMALL_SHARDS, device="cpu", **extra)}


PLACEMENTS = ["dram", "nvme", "max_in_cpu", "pins"]
"""The static placements every equivalence test runs in (tests/test_gpu.py too)."""


@pytest.fixture
def tiny_gpt():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    return model, cfg


def gpt_batches(cfg, batch_size=4, seed=0):
    tokens = markov_tokens(cfg.vocab_size, 20_000, seed=seed)
    return TokenBatches(tokens, batch_size, cfg.block_size, seed=seed)


def clone(model):
    return copy.deepcopy(model)
