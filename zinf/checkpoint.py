"""Crash-safe checkpoints of the whole training state, NVMe-resident data included.

Layout, simple enough to inspect by hand (one file per tensor plus an index, as accelerate does)::

    DIR/latest                      name of the newest complete checkpoint, e.g. "step-00000020"
    DIR/step-00000020/index.json    counters, placement, shards and their members, per-member steps
    DIR/step-00000020/rng.pt        torch RNG states
    DIR/step-00000020/shards/00003.master.bin, 00003.exp_avg.bin, ...   (zinf shard-file format)

A save writes everything into ``DIR/.tmp-step-...-<uuid>/``, fsyncs every file and the folders,
renames the folder to ``step-N`` and only then switches ``latest`` (write-new, fsync, rename).
A save killed at any moment therefore leaves ``latest`` pointing at the previous complete
checkpoint, which is deleted only after the new one is in place. NVMe shard files are hard-linked
into the checkpoint when they share a filesystem (swap files are only ever replaced, never
modified in place, so the link keeps the saved version).

The state is placement-independent: a checkpoint loads into an engine with another placement,
chunking or tiers, as long as the parameter names and shapes agree.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from zinf.errors import CheckpointError, StorageError, ZinfError
from zinf.storage.fsinfo import o_direct_supported
from zinf.storage.io import ThreadPoolBackend
from zinf.storage.shardfile import fsync_dir, read_tensor_file, write_tensor_file

FORMAT_VERSION = 1
KEEP_LAST = 2  # complete checkpoints kept in DIR (the newest and the one before it)


def _tag(step: int) -> str:
    return f"step-{step:08d}"


def _write_small(path: Path, data: bytes) -> None:
    """Write-new, fsync, rename: for index.json, rng.pt and latest."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prepare_dir(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise StorageError(f"checkpoint path {directory} is a file, not a directory; pass a directory path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create checkpoint directory {directory}: {exc.strerror}; choose a writable path") from None
    if not os.access(directory, os.W_OK):
        raise StorageError(f"checkpoint directory {directory} is not writable; fix its permissions or choose another path")


def save_checkpoint(engine, directory: Path, keep_last: int = KEEP_LAST) -> Path:
    """Save ``engine``'s state under ``directory``; returns the new checkpoint's folder."""
    if engine.micro_steps % engine.gradient_accumulation_steps != 0:
        raise CheckpointError(
            f"save_checkpoint was called after micro-batch {engine.micro_steps}, inside a gradient-accumulation "
            f"window of {engine.gradient_accumulation_steps}; save right after the engine.step() that updates"
        )
    directory = Path(directory).absolute()
    _prepare_dir(directory)
    for leftover in directory.glob(".tmp-step-*"):  # a save killed earlier
        shutil.rmtree(leftover, ignore_errors=True)
    tag = _tag(engine.global_steps)
    staging = directory / f".tmp-{tag}-{uuid.uuid4().hex[:8]}"
    (staging / "shards").mkdir(parents=True)
    backend = ThreadPoolBackend(engine.config.aio.block_size, engine.config.aio.queue_depth, engine.config.aio.thread_count)
    o_direct = o_direct_supported(directory)
    try:
        shards_index = []
        for st in engine.states:
            files = {}
            for what, source in _saved_states(engine, st):
                dest = staging / "shards" / f"{st.shard.index:05d}.{what}.bin"
                if isinstance(source, str):  # a key of an NVMe store: link (or copy) the file
                    store = engine._stores["optim" if what != "param" else "param"]
                    store.link_to(source, dest)
                else:
                    write_tensor_file(dest, source, backend=backend, o_direct=o_direct)
                files[what] = dest.name
            shards_index.append(
                {
                    "name": st.name,
                    "members": [{"names": m.names, "offset": m.offset, "numel": m.numel, "shape": list(m.shape)} for m in st.shard.members],
                    "steps": list(st.steps),
                    "has_moments": st.has_moments,
                    "trainable": st.shard.trainable,
                    "files": files,
                }
            )
        rng = io.BytesIO()
        torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, rng)
        _write_small(staging / "rng.pt", rng.getvalue())
        index = {
            "format_version": FORMAT_VERSION,
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "optimizer": engine.optimizer.type,
            "state_names": list(engine.optimizer.state_names),
            "placement": engine.placement,
            "config": engine.config.to_dict(),
            "shards": shards_index,
        }
        _write_small(staging / "index.json", json.dumps(index, indent=1).encode())
        fsync_dir(staging / "shards")
        fsync_dir(staging)
        # switch: the new folder takes its name, then `latest` points at it
        final = directory / tag
        if final.exists():  # re-saving the same step: move the old one aside first
            aside = directory / f".tmp-{tag}-old-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(staging, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(staging, final)
        fsync_dir(directory)
        _write_small(directory / "latest", tag.encode())
        fsync_dir(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        backend.close()
    # only now may older checkpoints go
    complete = sorted(p for p in directory.glob("step-*") if p.is_dir() and p.name != tag)
    for old in complete[: max(0, len(complete) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _saved_states(engine, st):
    """(state name, tensor or NVMe key) pairs that make up a shard in a checkpoint."""
    if not st.shard.trainable:
        if st.place.param == "nvme":
            yield "param", st.key("param")
        else:
            yield "param", st.param_home.to("cpu")
        return
    names = ("master", *engine.optimizer.state_names) if st.has_moments else ("master",)
    for what in names:
        if st.place.optim == "nvme":
            yield what, st.key(what)
        else:
            yield what, st.master if what == "master" else st.moments[what]


def _resolve(directory: Path) -> Path:
    directory = Path(directory).absolute()
    if (directory / "index.json").is_file():
        return directory
    latest = directory / "latest"
    if not latest.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (no 'latest' file and no index.json); pass the directory given to save_checkpoint")
    folder = directory / latest.read_text().strip()
    if not (folder / "index.json").is_file():
        raise CheckpointError(f"checkpoint {folder} named by {latest} is incomplete (no index.json); restore it from a backup")
    return folder


def load_checkpoint(engine, directory: Path) -> None:
    """Load the newest checkpoint in ``directory`` into ``engine``, whatever its placement."""
    folder = _resolve(directory)
    try:
        index = json.loads((folder / "index.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {folder / 'index.json'}: {exc}; the checkpoint is damaged") from None
    if index.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder} has checkpoint format {index.get('format_version')}, this zinf reads {FORMAT_VERSION}")
    if index["optimizer"] != engine.optimizer.type:
        raise CheckpointError(f"{folder} was saved with optimizer {index['optimizer']}, the engine uses {engine.optimizer.type}; use the same optimizer.type")

    # where each parameter (by its first name) lives in the checkpoint
    where: dict[str, tuple[dict, dict]] = {}
    for sh in index["shards"]:
        for mem in sh["members"]:
            where[mem["names"][0]] = (sh, mem)
    ours = {m.name: m for st in engine.states for m in st.shard.members}
    missing = sorted(set(ours) - set(where))
    unexpected = sorted(set(where) - set(ours))
    if missing or unexpected:
        raise CheckpointError(f"{folder} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, m in ours.items():
        if list(m.shape) != where[name][1]["shape"]:
            raise CheckpointError(f"{folder}: parameter {name} has shape {where[name][1]['shape']} in the checkpoint, {list(m.shape)} in the model")

    backend = ThreadPoolBackend(engine.config.aio.block_size, engine.config.aio.queue_depth, engine.config.aio.thread_count)
    o_direct = o_direct_supported(folder)
    cache: dict[Path, torch.Tensor] = {}

    def ckpt_flat(sh: dict, what: str) -> torch.Tensor | None:
        fname = sh["files"].get(what)
        if fname is None:
            return None
        path = folder / "shards" / fname
        if path not in cache:
            cache.clear()  # shards come in the same order: keep one file in memory
            cache[path] = read_tensor_file(path, backend=backend, o_direct=o_direct).to(torch.float32)
        return cache[path]

    try:
        for st in engine.states:
            _load_shard(engine, st, where, ckpt_flat)
    except ZinfError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {folder}: {exc}") from None
    finally:
        backend.close()

    engine.global_steps = index["global_steps"]
    engine.micro_steps = index["micro_steps"]
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])


def _load_shard(engine, st, where, ckpt_flat) -> None:
    """Assemble one engine shard's master/moments from the checkpoint and put them in its homes."""
    numel = st.shard.numel
    state_names = engine.optimizer.state_names if st.shard.trainable else ()
    master = torch.empty(numel, dtype=torch.float32)
    moments = {name: torch.zeros(numel, dtype=torch.float32) for name in state_names}
    any_moments = False
    for i, m in enumerate(st.shard.members):
        sh, mem = where[m.name]
        src = slice(mem["offset"], mem["offset"] + mem["numel"])
        dst = slice(m.offset, m.offset + m.numel)
        master[dst] = ckpt_flat(sh, "master" if sh["trainable"] else "param")[src]
        k = sh["members"].index(mem)
        st.steps[i] = sh["steps"][k] if st.shard.trainable else 0
        if st.shard.trainable and sh["has_moments"]:
            any_moments = True
            for name in state_names:
                moments[name][dst] = ckpt_flat(sh, name)[src]
    # pending gradients of the interrupted run are not part of the state
    st.grad, st.grad_on_nvme, st.grad_members, st.grad_norms = None, False, set(), {}
    st.has_moments = any_moments
    if st.shard.trainable:
        if st.place.optim == "nvme":
            store = engine._stores["optim"]
            store.write(st.key("master"), master)
            for name, t in moments.items():
                if any_moments:
                    store.write(st.key(name), t)
            if store.exists(st.key("grad")):
                store.delete(st.key("grad"))
        else:
            st.master.copy_(master)
            st.moments = moments if any_moments else {}
    if st.place.param == "nvme":
        if not engine._param_file_is_master(st):  # else the master file written above is it
            engine._stores["param"].write(st.key("param"), master.to(engine.dtype))
    elif st.param_home is not st.master:
        st.param_home.copy_(master)
