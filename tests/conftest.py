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
    else:
        raise ValueError(kind)
    # the CPU is the compute device of these tests, also on a machine with a GPU (tests/test_gpu.py
    # runs the same cases on CUDA)
    return {"zero_optimization": zero, "zinf": dict(SMALL_SHARDS, device="cpu")}


PLACEMENTS = ["dram", "nvme", "max_in_cpu", "pins"]


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
