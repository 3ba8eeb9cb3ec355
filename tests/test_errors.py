"""Bad input: the right ZinfError subclass, a message naming the culprit, and nothing left on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zinf
from zinf.errors import BudgetError, ConfigError, CorruptShardError, StorageError, ZinfError
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

from conftest import placement_config


def _tiny():
    torch.manual_seed(0)
    return build_model("gpt", "tiny")


def _files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_misspelt_key_names_it_and_writes_nothing(tmp_path):
    model, _ = _tiny()
    cfg = placement_config("nvme", tmp_path)
    cfg["zero_optimization"]["offload_param"]["nvme_pth"] = str(tmp_path / "x")
    with pytest.raises(ConfigError, match=r"nvme_pth.*nvme_path"):
        zinf.initialize(model, cfg)
    assert _files_under(tmp_path) == []
    # the model is untouched: its parameters still hold their data
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())


def test_nvme_path_that_is_a_file(tmp_path):
    model, _ = _tiny()
    f = tmp_path / "not-a-dir"
    f.write_text("user data")
    cfg = placement_config("nvme", tmp_path)
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = str(f)
    with pytest.raises(StorageError, match=str(f)):
        zinf.initialize(model, cfg)
    assert f.read_text() == "user data"


def test_nvme_path_that_cannot_be_created(tmp_path):
    model, _ = _tiny()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = blocker / "swap"  # a directory inside a regular file cannot exist
    cfg = placement_config("nvme", tmp_path)
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = str(bad)
    with pytest.raises(StorageError, match=str(bad)):
        zinf.initialize(model, cfg)


def test_nvme_path_read_only(tmp_path):
    model, _ = _tiny()
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        cfg = placement_config("nvme", tmp_path)
        for section in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][section]["nvme_path"] = str(ro)
        with pytest.raises(StorageError, match=str(ro)):
            zinf.initialize(model, cfg)
    finally:
        subprocess.run(["umount", str(ro)])


def test_nvme_path_too_small(tmp_path):
    model, _ = _tiny()
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        cfg = placement_config("nvme", tmp_path)
        for section in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][section]["nvme_path"] = str(small)
        with pytest.raises(StorageError, match=r"free"):
            zinf.initialize(model, cfg)
        assert _files_under(small) == []
    finally:
        subprocess.run(["umount", str(small)])


def test_budget_too_small_is_refused_before_anything_is_written(tmp_path):
    model, _ = _tiny()
    cfg = placement_config("dram", tmp_path)
    cfg["zinf"]["dram_budget"] = "1MiB"
    with pytest.raises(BudgetError, match=r"dram_budget"):
        zinf.initialize(model, cfg)
    cfg = placement_config("nvme", tmp_path)
    cfg["zinf"]["dram_budget"] = "4KiB"
    with pytest.raises(BudgetError, match=r"minimum working set"):
        zinf.initialize(model, cfg)
    assert _files_under(tmp_path) == []


def test_corrupted_swap_file_names_shard_and_file(tmp_path):
    model, mcfg = _tiny()
    data = TokenBatches(markov_tokens(mcfg.vocab_size, 5000), 2, mcfg.block_size)
    with zinf.initialize(model, placement_config("nvme", tmp_path)) as engine:
        x, y = data.get(0)
        engine.backward(engine(x, y))
        engine.step()
        st = engine.states[0]
        key = engine._param_key(st)  # fp32 on NVMe: forward reads the master file
        path = engine._stores["param"].path(key)
        engine._drain()  # let the prefetch started by step() land, so the next reads see the flip
        raw = bytearray(path.read_bytes())
        raw[4096] ^= 0x01
        path.write_bytes(bytes(raw))
        with pytest.raises(CorruptShardError) as info:
            engine(x, y)
        assert str(path) in str(info.value) and key in str(info.value)


def test_every_error_is_a_zinf_error():
    for cls in (ConfigError, StorageError, BudgetError, CorruptShardError):
        assert issubclass(cls, ZinfError)


def test_cli_prints_one_line_and_exits_nonzero(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, "-m", "zinf.cli", "demo", "--preset", "bogus", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "bogus" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
