"""Checkpoints: resume is bit-identical, and a save killed at any moment never costs the last good one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import zinf
from zinf.errors import CheckpointError
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

from conftest import placement_config
from test_equivalence import train_steps

OPT = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}


def _model_and_data():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    return model, TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=5), 4, cfg.block_size, seed=5)


@pytest.mark.parametrize("placement", ["dram", "nvme", "pins"])
def test_resume_is_bit_identical(placement, tmp_path):
    cfg = dict(placement_config(placement, tmp_path), optimizer=OPT, gradient_clipping=1.0)
    model, data = _model_and_data()
    fresh_model, _ = _model_and_data()  # same init; its weights are overwritten by the load anyway
    with zinf.initialize(model, cfg) as straight:
        train_steps(straight, data, 10)
        straight.save_checkpoint(tmp_path / "ckpt")
        expected_losses = train_steps(straight, data, 10, first=10)
        expected = straight.state_dict()

    # a second engine, another placement even, resumes from the checkpoint
    cfg2 = dict(placement_config("max_in_cpu" if placement != "dram" else "nvme", tmp_path, fresh_model), optimizer=OPT, gradient_clipping=1.0)
    with zinf.initialize(fresh_model, cfg2) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.global_steps == 10
        losses = train_steps(resumed, data, 10, first=10)
        got = resumed.state_dict()
    assert losses == expected_losses
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_checkpoint_layout_and_bad_loads(tmp_path):
    model, data = _model_and_data()
    with zinf.initialize(model, dict(placement_config("nvme", tmp_path), optimizer=OPT)) as engine:
        train_steps(engine, data, 2)
        folder = engine.save_checkpoint(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "latest").read_text() == folder.name
        index = json.loads((folder / "index.json").read_text())
        assert index["global_steps"] == 2
        assert all((folder / "shards" / f).is_file() for sh in index["shards"] for f in sh["files"].values())
        with pytest.raises(CheckpointError, match="no checkpoint in"):
            engine.load_checkpoint(tmp_path / "nothing-here")
        # a flipped byte in a shard file is caught by its checksum, naming the file
        victim = folder / "shards" / index["shards"][0]["files"]["master"]
        raw = bytearray(victim.read_bytes())
        raw[4096 + 10] ^= 0xFF
        victim.chmod(0o644)
        os.unlink(victim)  # the file may be a hard link into the swap dir: replace, don't edit
        victim.write_bytes(bytes(raw))
        with pytest.raises(zinf.errors.CorruptShardError, match=victim.name):
            engine.load_checkpoint(tmp_path / "ckpt")
    # a model with other parameters is refused with the names
    torch.manual_seed(0)
    other, _ = build_model("gpt", "tiny", n_layer=1)
    with zinf.initialize(other, dict(placement_config("dram", tmp_path), optimizer=OPT)) as engine:
        with pytest.raises(CheckpointError, match="does not match the model"):
            engine.load_checkpoint(tmp_path / "ckpt")


def test_save_inside_accumulation_window_is_refused(tmp_path):
    model, data = _model_and_data()
    with zinf.initialize(model, dict(placement_config("dram", tmp_path), optimizer=OPT, gradient_accumulation_steps=2)) as engine:
        x, y = data.get(0)
        engine.backward(engine(x, y))
        engine.step()
        with pytest.raises(CheckpointError, match="accumulation"):
            engine.save_checkpoint(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


KILLER = textwrap.dedent(
    """
    import sys, torch, zinf
    sys.path.insert(0, {tests!r})
    from conftest import placement_config
    from zinf.models import build_model
    from zinf.models.data import TokenBatches, markov_tokens
    from pathlib import Path
    tmp = Path({tmp!r})
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    data = TokenBatches(markov_tokens(cfg.vocab_size, 5000, seed=0), 2, cfg.block_size, seed=0)
    engine = zinf.initialize(model, dict(placement_config("nvme", tmp), optimizer={{"type": "AdamW"}}, zinf={{"chunk_size": "64KiB", "shard_min_bytes": "16KiB", "run_name": "killer"}}))
    step = 0
    while True:
        x, y = data.get(step); step += 1
        engine.backward(engine(x, y)); engine.step()
        engine.save_checkpoint(tmp / "ckpt")
        print("saved", engine.global_steps, flush=True)
    """
)


def test_sigkill_during_save_never_loses_the_last_good_checkpoint(tmp_path):
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)))
    rng = random.Random(0)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    kills = 0
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        # wait for the first completed save, then kill at a random moment of a later one
        line = proc.stdout.readline()
        assert line.startswith("saved"), proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        torch.manual_seed(0)
        model, _ = build_model("gpt", "tiny")
        with zinf.initialize(model, dict(placement_config("dram", tmp_path), optimizer={"type": "AdamW"})) as engine:
            engine.load_checkpoint(tmp_path / "ckpt")  # must always succeed
            assert engine.global_steps >= 1
    assert kills == 6
