"""A process SIGKILLed during a migration restarts from its last checkpoint with nothing lost.

A child process (``sys.executable``, this very module's :func:`_child_main`) trains the tiny GPT
with zinf on the CPU in fp32 -- param homes half in DRAM, half on NVMe (``max_in_cpu``); optimizer
homes on NVMe except every third shard's, moved to DRAM by a migration after step 2 -- saves a
checkpoint after step ``K`` and then migrates many homes both ways (param and optimizer, cpu ->
nvme and nvme -> cpu). It is killed with SIGKILL in the middle of that migration:

* at a point chosen inside one move, deterministically, by a hook the child installs on the
  migration path that calls ``os.kill(os.getpid(), SIGKILL)``: in the middle of writing a new
  swap file (its header not yet written), once a move's new files are durable and verified but
  before the switch, after the switch but before the old files are freed, and halfway through
  freeing them;
* or by the parent, at a moment drawn from a fixed seed, while the child loops migrating back
  and forth, training a step before every second migration (the first one right after the
  checkpoint, so the swap files that the checkpoint holds hard links to are replaced).

The parent then checks the dead run's swap directory (every file under a key's name is whole:
header, length and CRC-32 verify; the torn write is only in a hidden temporary file), the
checkpoint (complete, every file's CRC verifies, every value bit-equal to plain PyTorch's state
after step ``K``), and restarts: a new engine in this process -- another process than the killed
one -- with the same config and swap directory (the same run name, so the dead run's directory is
in its way), loaded from the checkpoint. Every shard's param, master, exp_avg and exp_avg_sq must
equal plain PyTorch's after step ``K`` bit for bit, every swap file must verify, and training on
must give exactly plain PyTorch's losses and final parameters (``==`` / ``torch.equal``).
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

import zinf
from zinf.errors import ZinfError
from zinf.models import build_model
from zinf.placement import Move
from zinf.storage.io import ThreadPoolBackend
from zinf.storage.shardfile import read_tensor_file

from conftest import SMALL_SHARDS
from test_equivalence import OPT, _gpt

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
K = 3  # the checkpoint is saved after this many optimizer steps
N = 6  # steps of the whole run: the restarted one trains K..N-1
RUN_NAME = "crashrun"  # fixed, so that the restart opens the very swap directory the dead run left
STATES = ("master", "exp_avg", "exp_avg_sq")
CHILD_TIMEOUT_S = 60


def _config(nvme: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": OPT,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 834304 // 2},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
        },
        "zinf": {**SMALL_SHARDS, "device": "cpu", "run_name": RUN_NAME},
    }


def _other(tier: str) -> str:
    return "nvme" if tier == "cpu" else "cpu"


def _flips(engine, i: int) -> list[Move]:
    """Flip the optimizer home of every second shard and the param home of every third one (a
    different subset for each ``i``), param move first."""
    moves = []
    for j, (name, homes) in enumerate(engine.placement.items()):
        if j % 3 == (i + 1) % 3:
            moves.append(Move(name, "param", _other(homes["param"])))
        if j % 2 == i % 2:
            moves.append(Move(name, "optim", _other(homes["optim"])))
    return moves


def _train_step(engine, data, step: int) -> float:
    x, y = data.get(step)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.item()


# --------------------------------------------------------------------------------------------
# The child: train, checkpoint, migrate, die


def _die(point: str, relocations: int, shard: int) -> None:
    print(f"killed {point} {relocations} {shard}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(point: str, nth: int = 2) -> None:
    """Patch the migration path of this (child) process so that it SIGKILLs itself at ``point``
    during the ``nth`` move of the kind that point belongs to (earlier moves are complete)."""
    from zinf.engine import Engine
    from zinf.storage import shardfile
    from zinf.storage.nvme import NvmeStore

    count = {"relocate": 0, "hits": 0}
    armed: dict = {}
    real_relocate = Engine._relocate

    def relocate(self, st, new):
        count["relocate"] += 1
        armed["shard"] = st.shard.index
        return real_relocate(self, st, new)

    Engine._relocate = relocate

    def hit() -> bool:
        count["hits"] += 1
        return count["hits"] == nth

    def die() -> None:
        _die(point, count["relocate"], armed["shard"])

    if point == "torn_write":  # the 2nd file of an optimizer group going to NVMe, before its header lands
        real_write_verified, real_writev, real_write = Engine._write_verified, shardfile.writev_full, shardfile.write_full

        def write_verified(self, store, key, t):
            if key.endswith(".exp_avg") and hit():
                armed["torn"] = True
            return real_write_verified(self, store, key, t)

        def writev_full(fd, views, offset):
            if armed.get("torn"):  # header + payload in one call: let the header block alone land
                real_writev(fd, views[:1], offset)
                die()
            return real_writev(fd, views, offset)

        def write_full(fd, view, offset):
            if armed.get("torn"):  # the payload went through staging windows; the header is last
                die()
            return real_write(fd, view, offset)

        Engine._write_verified = write_verified
        shardfile.writev_full, shardfile.write_full = writev_full, write_full
    elif point == "before_switch":  # optimizer group written to NVMe, durable and verified
        real_switch = Engine._switch

        def switch(self, st, new, copies):
            if st.place.optim == "cpu" and new.optim == "nvme" and hit():
                die()
            return real_switch(self, st, new, copies)

        Engine._switch = switch
    elif point in ("before_free", "mid_free"):  # optimizer group moved to DRAM, old files still there
        real_free, real_delete = Engine._free_homes, NvmeStore.delete

        def free_homes(self, st, dropped):
            if ("nvme", "master") in dropped and hit():
                if point == "before_free":
                    die()
                armed["deleting"] = True
            return real_free(self, st, dropped)

        def delete(self, key):
            real_delete(self, key)
            if armed.get("deleting"):  # the first old file is gone, the others are not
                die()

        Engine._free_homes, NvmeStore.delete = free_homes, delete
    else:
        raise ValueError(point)


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    model, data = _gpt()
    engine = zinf.initialize(model, _config(Path(spec["nvme"])))
    for step in range(K):
        _train_step(engine, data, step)
        if step == 1:  # optimizer homes of every third shard to DRAM: both tiers hold both kinds of home
            moves = [Move(name, "optim", "cpu") for j, name in enumerate(engine.placement) if j % 3 == 0]
            assert engine.migrate(moves).done == moves
    engine.save_checkpoint(spec["ckpt"])
    print("ready", json.dumps(engine.placement), flush=True)
    if spec["point"] == "random":
        for i in range(1_000_000):  # until the parent kills it
            if i % 2 == 0:  # rewrites the swap files the checkpoint holds hard links to
                _train_step(engine, data, K + i // 2)
            report = engine.migrate(_flips(engine, i))
            assert report.done and not report.refused, report
            print("migrated", i, flush=True)
    else:
        _install_kill(spec["point"])
        engine.migrate(_flips(engine, 0))
        print("the migration ended without being killed", flush=True)
    sys.exit(3)


def _spawn(tmp_path: Path, point: str) -> subprocess.Popen:
    spec = json.dumps({"nvme": str(tmp_path / "nvme"), "ckpt": str(tmp_path / "ckpt"), "point": point})
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(REPO)!r}]; "
            f"import test_migration_crash as t; t._child_main(sys.argv[1])")
    return subprocess.Popen([sys.executable, "-c", code, spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)


def _run_until_killed(tmp_path: Path, point: str, seed: int | None = None) -> list[str]:
    """Run the child; for ``point`` "random", SIGKILL it ``seed``-drawn seconds after its first
    completed migration. Returns its stdout lines; asserts it died of SIGKILL."""
    lines: list[str] = []
    with _spawn(tmp_path, point) as child:
        got_line = threading.Event()

        def read() -> None:
            for line in child.stdout:
                lines.append(line.strip())
                got_line.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if point == "random":
                deadline = time.monotonic() + CHILD_TIMEOUT_S
                while not any(s.startswith("migrated") for s in lines):
                    assert child.poll() is None, f"the child ended early: {child.stderr.read()[-3000:]}"
                    assert time.monotonic() < deadline, "the child did not start migrating"
                    got_line.wait(0.05)
                    got_line.clear()
                time.sleep(random.Random(seed).uniform(0.0, 0.6))
                assert child.poll() is None, f"the child ended early: {child.stderr.read()[-3000:]}"
                child.send_signal(signal.SIGKILL)
            child.wait(CHILD_TIMEOUT_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        reader.join(10)
        stderr = child.stderr.read()
    assert child.returncode == -signal.SIGKILL, f"child exited with {child.returncode}: {lines[-3:]} {stderr[-3000:]}"
    return lines


# --------------------------------------------------------------------------------------------
# The reference: plain PyTorch, uninterrupted


@functools.lru_cache(maxsize=1)
def _reference():
    """Plain PyTorch (torch.optim.AdamW, fp32 CPU) on the same model and batches: the losses of
    all N steps, and {param name: {"master", "exp_avg", "exp_avg_sq": tensor, "step": int}} after
    step K and after step N."""
    with torch.random.fork_rng():
        model, data = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        losses, at_k = [], None
        for step in range(N):
            x, y = data.get(step)
            loss = model(x, y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step + 1 == K:
                at_k = _snapshot(model, opt)
        return losses, at_k, _snapshot(model, opt)


def _snapshot(model, opt) -> dict:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        state = opt.state[p]
        out[name] = {"master": p.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                     "exp_avg_sq": state["exp_avg_sq"].clone(), "step": int(state["step"])}
    return out


def _assert_member_equal(flat: torch.Tensor, member_names, offset: int, numel: int, shape, what: str,
                         expected: dict, where: str) -> None:
    got = flat.reshape(-1)[offset: offset + numel].view(shape)
    for name in member_names:
        same = got.dtype == torch.float32 and torch.equal(got, expected[name][what])
        assert same, f"{where}: {what} of {name} differs from plain PyTorch's after step {K}"


# --------------------------------------------------------------------------------------------
# Checks after the kill


def _visible_and_hidden(run_dir: Path) -> tuple[list[Path], list[Path]]:
    files = [p for p in run_dir.iterdir() if p.name.endswith(".shard")]
    return [p for p in files if not p.name.startswith(".")], [p for p in files if p.name.startswith(".")]


def _readable(path: Path, backend, key: str | None = None) -> bool:
    try:
        read_tensor_file(path, backend=backend, o_direct=False, key=key)
    except ZinfError:
        return False
    return True


def _check_dead_swap_dir(run_dir: Path, point: str, shard: int | None, backend) -> None:
    """Every file the dead run left under a key's name is whole (header, length, CRC-32); a torn
    write lies only under a hidden temporary name; the kill landed where it was meant to."""
    assert (run_dir / "ZINF_SWAP").is_file() and (run_dir / "owner.lock").is_file()
    visible, hidden = _visible_and_hidden(run_dir)
    assert visible, "the dead run left no swap files: nothing was checked"
    for path in visible:
        key = unquote(path.name[: -len(".shard")])
        read_tensor_file(path, backend=backend, o_direct=False, key=key)  # raises CorruptShardError
    if shard is None:
        return
    names = {unquote(p.name[: -len(".shard")]) for p in visible}
    group = {f"{shard:05d}.{n}" for n in STATES}
    if point == "torn_write":  # master written and switched in, exp_avg torn, exp_avg_sq not begun
        assert f"{shard:05d}.master" in names and not (group - {f"{shard:05d}.master"}) & names, names
        assert any(not _readable(p, backend) for p in hidden), "no torn temporary file: the kill was not mid-write"
    elif point in ("before_switch", "before_free"):  # the whole group durable on NVMe
        assert group <= names, names
    elif point == "mid_free":  # the master file deleted, the moments not yet
        assert f"{shard:05d}.master" not in names and group - {f"{shard:05d}.master"} <= names, names


def _check_checkpoint(ckpt: Path, expected: dict, backend) -> None:
    """The checkpoint is the one saved after step K, complete (no temporary leftovers), every file's
    CRC-32 verifies and every value equals plain PyTorch's after step K."""
    tag = f"step-{K:08d}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", tag]
    assert (ckpt / "latest").read_text() == tag
    folder = ckpt / tag
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "rng.pt", "shards"]
    index = json.loads((folder / "index.json").read_text())
    assert (index["global_steps"], index["micro_steps"]) == (K, K)
    listed = set()
    covered = set()
    for sh in index["shards"]:
        assert set(sh["files"]) == set(STATES) and sh["has_moments"] and sh["trainable"]
        for what, fname in sh["files"].items():
            listed.add(fname)
            flat = read_tensor_file(folder / "shards" / fname, backend=backend, o_direct=False)  # CRC verified
            for mem, steps in zip(sh["members"], sh["steps"]):
                assert steps == K
                _assert_member_equal(flat, mem["names"], mem["offset"], mem["numel"], mem["shape"], what,
                                     expected, f"checkpoint {fname}")
                covered.update(mem["names"])
    assert {p.name for p in (folder / "shards").iterdir()} == listed
    assert covered == set(expected)


def _check_engine_state(engine, expected: dict) -> None:
    """Every shard's homes in the restarted engine hold plain PyTorch's state after step K."""
    for st in engine.states:
        assert st.has_moments and st.steps == [K] * len(st.shard.members)
        homes = {}
        for what in STATES:
            if st.place.optim == "nvme":
                homes[what] = engine._stores["optim"].read(st.key(what))  # CRC verified
            else:
                homes[what] = st.master if what == "master" else st.moments[what]
        if st.place.param == "nvme":
            param = engine._stores["param"].read(engine._param_key(st))
        else:
            param = st.param_home
        for m in st.shard.members:
            for what in STATES:
                _assert_member_equal(homes[what], m.names, m.offset, m.numel, m.shape, what, expected, st.name)
            _assert_member_equal(param, m.names, m.offset, m.numel, m.shape, "master", expected, f"{st.name} param")
            for name in m.names:
                assert expected[name]["step"] == K


def _restart_and_check(tmp_path: Path, backend) -> None:
    ref_losses, at_k, final = _reference()
    nvme, run_dir = tmp_path / "nvme", tmp_path / "nvme" / f"zinf-{RUN_NAME}"
    with torch.random.fork_rng():
        torch.manual_seed(1234)  # other initial weights than the run's: only the checkpoint can restore them
        model = build_model("gpt", "tiny")[0]
        _, data = _gpt()
        with pytest.warns(UserWarning, match=f"removed {run_dir}: swap directory left by a run"):
            engine = zinf.initialize(model, _config(nvme))
        with engine:
            assert json.loads((run_dir / "ZINF_SWAP").read_text())["pid"] == os.getpid()
            engine.load_checkpoint(tmp_path / "ckpt")
            assert (engine.global_steps, engine.micro_steps) == (K, K)
            _check_engine_state(engine, at_k)
            store = engine._stores["optim"]
            assert set(store.keys()) == {p.name[: -len(".shard")] for p in _visible_and_hidden(run_dir)[0]}
            for key in store.keys():
                store.read(key)  # every swap file of the restarted run verifies
            losses = [_train_step(engine, data, step) for step in range(K, N)]
            params = engine.state_dict()
    assert losses == ref_losses[K:]
    assert set(params) == set(final)
    for name, ref in final.items():
        assert torch.equal(params[name], ref["master"]), f"{name} differs from plain PyTorch after step {N}"


# --------------------------------------------------------------------------------------------
# The tests


@pytest.fixture
def backend():
    backend = ThreadPoolBackend(1 << 20, 8, 2)
    yield backend
    backend.close()


@pytest.mark.parametrize("point", ["torn_write", "before_switch", "before_free", "mid_free"])
def test_killed_inside_a_move_restarts_from_the_checkpoint(point, tmp_path, backend):
    lines = _run_until_killed(tmp_path, point)
    killed = [line.split() for line in lines if line.startswith("killed")]
    assert killed, f"the kill hook did not fire: {lines[-3:]}"
    _, where, relocations, shard = killed[0]
    assert where == point and int(relocations) >= 3, killed  # moves before this one were complete
    _check_dead_swap_dir(tmp_path / "nvme" / f"zinf-{RUN_NAME}", point, int(shard), backend)
    _check_checkpoint(tmp_path / "ckpt", _reference()[1], backend)
    _restart_and_check(tmp_path, backend)


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_at_a_random_moment_of_migrating_back_and_forth(seed, tmp_path, backend):
    lines = _run_until_killed(tmp_path, "random", seed)
    migrations = sum(line.startswith("migrated") for line in lines)
    assert migrations >= 1
    _check_dead_swap_dir(tmp_path / "nvme" / f"zinf-{RUN_NAME}", "random", None, backend)
    _check_checkpoint(tmp_path / "ckpt", _reference()[1], backend)
    _restart_and_check(tmp_path, backend)
