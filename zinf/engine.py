"""The zinf engine: wraps a model, keeps its state in its tiers, and runs forward, backward and the
optimizer phase the way plain PyTorch would.

How a step goes (see docs/architecture.md, "Anatomy of a step"):

1. **Forward.** A forward-pre-hook on each module that directly owns parameters materialises
   their shards on the compute device (a copy from the DRAM home, or the NVMe read that the
   prefetcher started earlier along the recorded trace: :mod:`zinf.prefetch`); the
   forward-post-hook frees them again. Shards whose param home *is* the compute device stay
   resident and cost nothing.
2. **Backward.** A full-backward-pre-hook materialises the module's shards again (autograd saved
   the parameter tensors, whose storage was freed and is now refilled in place), the
   full-backward-hook frees them. A post-accumulate-grad hook moves each gradient, as soon as it
   is final, into the shard's fp32 accumulator and drops the device copy. For a shard whose
   optimizer home is NVMe the accumulator is written out asynchronously, or, at the last
   micro-batch with clipping off, the shard is updated right there on a worker thread
   (``zinf.overlap_optimizer``).
3. **Optimizer phase** (at the accumulation boundary). For each shard with a gradient: clip,
   update each member that got a gradient (``zinf.optim``), refresh the param home. NVMe groups
   are pipelined: the read of the next group, the update of this one and the write-back of the
   previous ones overlap (``pipeline_read`` / ``pipeline_write``).

Parameter storage is freed with ``untyped_storage().resize_(0)`` and refilled with
``resize_`` + a copy through ``.data`` (which does not bump autograd's version counter), the
technique FSDP2 uses, so tensors autograd saved in forward see the data again in backward.

Where an fp32 working copy and the fp32 master would hold the same bytes (fp32 training on the
CPU), one copy serves both: in DRAM one tensor, on NVMe one file (the ``master`` file is what
forward reads).

4. **Between steps.** :meth:`Engine.migrate` moves homes between DRAM and NVMe (write the new
   home, make it durable, verify it, switch, free the old one); a ``controller`` set on the engine
   is asked for moves after every optimizer step.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from zinf import events as ev
from zinf import hints
from zinf.config import Config, load_config
from zinf.errors import BudgetError, ConfigError, CorruptShardError, ModelError
from zinf.hardware import describe, rss_bytes
from zinf.loss_scale import LossScaler
from zinf.optim import OptimizerSpec, clip_coefficient
from zinf.pins import PinSet
from zinf.placement import (
    DramNeed,
    MigrationReport,
    Move,
    PlacementController,
    ShardPlacement,
    check_budget,
    fmt_bytes,
    static_placement,
)
from zinf.prefetch import Prefetcher, PrefetchStats
from zinf.shards import Member, Shard, build_shards
from zinf.sizing import DramSizing, Overlap, ShardSizes
from zinf.spans import span
from zinf.storage.aligned import BufferPool, aligned_empty
from zinf.threads import single_threaded_torch

log = logging.getLogger("zinf")


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality of two contiguous tensors (NaNs included, unlike torch.equal)."""
    return a.dtype == b.dtype and a.numel() == b.numel() and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class ParamState(enum.Enum):
    """Where a shard's working copy is right now.

    RESIDENT: the param tensors *are* (views of) the param home; nothing to fetch or free.
    FREED: the param tensors have zero-size storage; the data is only in the home.
    MATERIALISED: the param tensors hold a copy fetched from the home, freed when released.
    PREFETCHED: (CUDA) the param tensors' upload was issued ahead of their use along the trace;
    nobody uses them yet (the compute stream waits for the upload's event at the first use).
    """

    RESIDENT = "resident"
    FREED = "freed"
    MATERIALISED = "materialised"
    PREFETCHED = "prefetched"


@dataclass(eq=False)
class ShardState:
    """Everything the engine holds for one shard."""

    shard: Shard
    place: ShardPlacement
    param_state: ParamState = ParamState.FREED
    refcount: int = 0  # module activations currently using the materialised params
    param_home: Tensor | None = None  # flat DRAM/device copy in compute dtype (param tier gpu/cpu)
    master: Tensor | None = None  # flat fp32 master (optim tier gpu/cpu)
    moments: dict[str, Tensor] = field(default_factory=dict)  # flat fp32 optimizer state in DRAM
    has_moments: bool = False  # optimizer state exists (in DRAM or on NVMe)
    steps: list[int] = field(default_factory=list)  # optimizer steps taken, per member
    grad: Tensor | None = None  # flat fp32 gradient accumulator while in DRAM
    grad_buffer: Tensor | None = None  # the accumulator kept between steps (optimizer home in DRAM)
    grad_on_nvme: bool = False  # the accumulated gradient of this window sits in the grad file
    grad_read: Future | None = None  # that sum, read back ahead of this micro-batch's gradient
    grad_members: set[int] = field(default_factory=set)  # members with a gradient this window
    arrived_now: set[int] = field(default_factory=set)  # members whose grad arrived this backward
    grad_norms: dict[int, Tensor] = field(default_factory=dict)  # member -> 2-norm of its grad
    group_reads: dict[str, Future] | None = None  # optimizer group read ahead of its update
    upload_event: object | None = None  # (CUDA) the event of the param upload not yet waited for

    @property
    def name(self) -> str:
        return self.shard.name

    def key(self, what: str) -> str:
        return f"{self.shard.index:05d}.{what}"



class Engine:
    """A model wrapped for training with its state across GPU, DRAM and NVMe.

    Build it with :func:`zinf.initialize`. Call it like the model, then ``backward(loss)`` and
    ``step()`` after every micro-batch.
    """

    def __init__(self, model: nn.Module, config: Config | dict | str | os.PathLike | None = None, *,
                 recorder: ev.Recorder | None = None, controller: PlacementController | None = None):
        if not isinstance(model, nn.Module):
            raise ModelError(f"zinf.initialize needs a torch.nn.Module, got {type(model).__name__}")
        if hints.open_engine_of(model) is not None:  # it would re-home parameters the other engine freed
            raise ModelError("this model (or a module of it) is already wrapped by an open zinf engine; "
                             "close that engine first (engine.close()), or wrap a copy (copy.deepcopy(model))")
        self.config = cfg = load_config(config)
        self.module = model
        self.recorder = recorder or ev.NullRecorder()
        self.device = self._pick_device(cfg)
        self.dtype = cfg.compute_dtype
        self._cuda = None  # host <-> device copies on side streams (zinf.cuda), with a CUDA device
        if self.device.type == "cuda":
            from zinf.cuda import Transfers

            self._cuda = Transfers(self.device)
        self.loss_scaler = LossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else None  # fp16 only
        self.skipped_steps = 0  # optimizer steps skipped because an fp16 gradient overflowed
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        fused = cfg.zinf.fused_optimizer if cfg.zinf.fused_optimizer is not None else self.device.type == "cuda"
        self.optimizer = OptimizerSpec.from_config(cfg.optimizer, fused=fused)
        self.global_steps = 0  # optimizer steps taken
        self.micro_steps = 0  # engine.step() calls
        self.plan_version = 0
        self.run_name = cfg.zinf.run_name or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self._closed = False
        self._in_backward = False
        self._step_timer = _StepTimer()
        self._backward_held: list[ShardState] = []  # shards acquired by backward pre-hooks
        # Updates during backward read each NVMe shard's optimizer group when backward reaches its
        # module; one more is read ahead, in the order this pass's forward makes backward visit
        # them (reversed): which modules ran is this pass's, so a routed model's experts are
        # read for the experts it routed to (an earlier step's trace would guess).
        self._forward_order: dict[int, ShardState] = {}  # shard index -> state, first call first
        self._recomputes = False  # a pass recomputed activations in backward (checkpointing)
        # Shards acquired by a recomputed forward and not released yet: torch's checkpoint stops
        # a recomputation once it has the tensors it needs (early stop), so the post-forward hook
        # of the module it stopped in never runs; the end of backward releases them.
        self._recompute_held: list[ShardState] = []
        self._backward_queue: list[ShardState] = []  # this backward's NVMe groups, in their order
        self._backward_pos: dict[int, int] = {}  # shard index -> position in _backward_queue
        self._backward_updated: set[int] = set()  # shard indices updated during this backward
        self._read_ahead_st: ShardState | None = None  # the group read ahead, until its update
        self.backward_reads_ahead = 0  # groups read ahead during backward since initialize
        self.grad_reads_ahead = 0  # gradient sums read back ahead of their micro-batch's gradient
        self.traffic_total = _Traffic()  # bytes moved per tier since initialize
        self.last_step: dict = {}  # phase timings of the last optimizer step
        self._drained = False  # drain() ran since the last optimizer step: the next one starts cold
        self.controller = controller  # asked for migrations after every optimizer step (None: never)
        self.last_migration: MigrationReport | None = None  # outcome of the last migrate call
        self._controller_warnings: set[str] = set()  # messages of controller failures already logged
        self._window_open = False  # a forward (with grad) or backward ran since the last boundary

        # 1. shards and their placement
        zero = cfg.zero_optimization
        self._param_pins = param_pins = PinSet.from_config(zero.offload_param.module_parameters)
        self._optim_pins = optim_pins = PinSet.from_config(zero.offload_optimizer.module_parameters)
        self.shards: list[Shard] = build_shards(
            model,
            param_bytes_per_elem=self.dtype.itemsize,
            chunk_size=cfg.zinf.chunk_size,
            shard_min_bytes=cfg.zinf.shard_min_bytes,
            pin_for=param_pins.tier_for_param,
        )
        placements = static_placement(self.shards, cfg, optim_pin_for=optim_pins.tier_for_param)
        plan_file = cfg.zinf.placement.plan_file
        if plan_file is not None:  # a saved plan replaces what the offload devices and max_in_cpu say
            placements = self._placements_from_plan(plan_file, placements)
        elif self._cuda is not None:
            placements = self._persistent_on_gpu(placements)
        self.states = [ShardState(s, p, steps=[0] * len(s.members)) for s, p in zip(self.shards, placements)]
        self._state_by_name = {st.name: st for st in self.states}
        self._member_of: dict[int, tuple[ShardState, int]] = {
            id(m.param): (st, i) for st in self.states for i, m in enumerate(st.shard.members)
        }
        self._module_states = self._map_modules(model)
        if self._cuda is not None:
            self._buffers_to_device(model)

        # 2. refuse a budget the placement cannot meet, before touching any data; then size the
        #    overlap (prefetch window, optimizer read-ahead, writes in flight) from what is left
        self._stores: dict[str, object] = {}
        self.sizing = self._sizing()
        self.dram_need = self._dram_need()
        try:
            check_budget(self.dram_need, cfg.zinf.dram_budget)
        except BudgetError as e:
            if plan_file is None:
                raise
            raise BudgetError(f"{e}; the placement is zinf.placement.plan_file {str(plan_file)!r}: make a plan for "
                              f"this budget with `zinf plan --dram-budget SIZE`") from None
        self.overlap = self._size_overlap(cfg.zinf.dram_budget)
        self.dram_need.overlap_bytes = self.overlap.total_bytes
        # see _grad_download_cap; shards never change size, and this is read for every gradient
        self._grad_cap_bytes = max(16 << 20, 2 * max((st.shard.numel for st in self.states), default=0) * self.dtype.itemsize)
        self._check_gpu_budget()
        self._stats_lock = threading.Lock()
        self._buffers = BufferPool(max_free_bytes=self.overlap.total_bytes + self._largest_nvme_group_bytes(),
                                   pin=self.device.type == "cuda")
        self._prefetcher = self._new_prefetcher()
        self._writes = _WriteWindow(self.overlap.write_bytes)
        # With CUDA the CPU is free during backward: shards whose optimizer state is in DRAM are
        # updated there too, as their gradients become final (same conditions as for NVMe shards).
        self._eager_dram = (self._cuda is not None and cfg.zinf.overlap_optimizer and cfg.gradient_clipping == 0
                            and not cfg.fp16.enabled)
        self._eager = self._optimizer_worker() if self.overlap.eager or self._eager_dram else None
        self._eager_futures: list[Future] = []  # updates of NVMe groups queued (each holds its buffers)
        self._eager_dram_futures: list[Future] = []  # updates of DRAM homes queued (hold nothing extra)
        self._pass_held: set[ShardState] = set()  # chunks kept materialised until the pass ends
        self._prefetched: set[ShardState] = set()  # (CUDA) uploaded ahead along the trace, not used yet
        self._pending_grads: deque[tuple] = deque()  # (CUDA) gradient downloads not yet accumulated
        self._pending_grad_bytes = 0
        self._pass_open = False  # a forward/backward pass is under way along the trace

        # 3. open NVMe stores, move every shard to its homes, free the model's own copies
        self._run_started = False  # set-up I/O (the first write of every home) is not a step's
        self._io_log: deque[tuple] = deque()  # requests finished since the last IoBatch (see _on_io)
        try:
            self._open_stores()
            self._home_all()
        except BaseException:
            self._close_stores()
            raise
        self._hooks = self._install_hooks(model)
        hints.register(self, model)
        self._stats = _Traffic()
        self._losses: list[float] = []
        if self.recorder.enabled:
            self._emit_run_started()
            self._run_started = True

    # ------------------------------------------------------------------ set-up helpers
    @staticmethod
    def _pick_device(cfg: Config) -> torch.device:
        want = cfg.zinf.device
        if want == "cuda" and not torch.cuda.is_available():
            raise ConfigError("zinf.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _persistent_on_gpu(self, placements: list[ShardPlacement]) -> list[ShardPlacement]:
        """With a CUDA device, shards made only of parameters smaller than
        ``stage3_param_persistence_threshold`` elements stay on the GPU for the whole run (as
        DeepSpeed keeps them): fetching biases and norms costs a transfer each for a few KiB.
        Pinned homes keep their pin."""
        threshold = self.config.zero_optimization.stage3_param_persistence_threshold
        out = []
        for shard, place in zip(self.shards, placements):
            small = all(m.numel < threshold for m in shard.members)
            out.append(ShardPlacement("gpu", place.optim) if small and shard.pin is None else place)
        return out

    def _buffers_to_device(self, model: nn.Module) -> None:
        """Move the model's buffers (not parameters: those live in their homes) to the compute
        device, as ``model.to(device)`` would."""
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device != self.device:
                    mod._buffers[name] = buf.to(self.device)

    def gpu_need_bytes(self) -> int:
        """Bytes of GPU memory the engine takes at most (0 without CUDA): resident param homes (the
        ``gpu`` tier), the largest set of fetched params in use at once, the uploads issued ahead
        along the trace, and gradients waiting for their download. Activations are the model's."""
        if self._cuda is None:
            return 0
        resident = sum(self._nbytes(st)[0] for st in self.states if st.place.param == "gpu")
        return resident + self._live_param_bound() + self._upload_ahead_bytes() + self._grad_download_cap()

    def _upload_ahead_bytes(self) -> int:
        """(CUDA) Bytes of parameters uploaded ahead of their use along the trace:
        ``stage3_prefetch_bucket_size`` elements, DeepSpeed's GPU prefetch bucket."""
        elem = self.dtype.itemsize
        return self.config.zero_optimization.stage3_prefetch_bucket_size * elem

    def _check_gpu_budget(self) -> None:
        budget = self.config.zinf.gpu_budget
        need = self.gpu_need_bytes()
        if budget is None or need <= budget:
            return
        raise BudgetError(
            f"the placement needs up to {fmt_bytes(need)} of GPU memory for parameters and gradients (resident "
            f"{fmt_bytes(need - self._live_param_bound() - self._upload_ahead_bytes() - self._grad_download_cap())}, "
            f"in use at once {fmt_bytes(self._live_param_bound())}, uploaded ahead "
            f"{fmt_bytes(self._upload_ahead_bytes())}, gradients being downloaded {fmt_bytes(self._grad_download_cap())}) but "
            f"zinf.gpu_budget is {fmt_bytes(budget)}; raise gpu_budget, lower "
            f"zero_optimization.stage3_param_persistence_threshold or stage3_prefetch_bucket_size")

    def _placements_from_plan(self, path: Path, static: list[ShardPlacement]) -> list[ShardPlacement]:
        """The placement a saved plan file gives (``zinf.placement.plan_file``, written by ``zinf
        plan``), one entry per shard, instead of ``static`` (what the offload devices and
        ``max_in_cpu`` describe). The file must name exactly this model's shards; homes pinned by
        ``module_parameters`` must have their pinned tier; a frozen shard has no optimizer home.
        The DRAM budget is checked afterwards, as for any placement. Raises ConfigError (one line)."""
        from zinf.planfile import read_plan_file

        plan = read_plan_file(path)["placement"]
        where = f"zinf.placement.plan_file {str(path)!r}"
        remake = ("make a new plan with `zinf plan` from a profiled run of this model with these shard settings "
                  "(zinf.chunk_size, zinf.shard_min_bytes) and precision")
        names = [s.name for s in self.shards]
        known = set(names)
        unknown = [n for n in plan if n not in known]
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise ConfigError(f"{where} names shard {unknown[0]!r}{more}, which this model does not have; {remake}")
        missing = [n for n in names if n not in plan]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(f"{where} has no entry for shard {missing[0]!r}{more} of this model; {remake}")
        out = []
        for shard, default in zip(self.shards, static):
            param, optim = plan[shard.name]["param"], plan[shard.name]["optim"]
            if not shard.trainable and optim != "none":
                raise ConfigError(f"{where} gives frozen shard {shard.name!r} (requires_grad=False) an optimizer home "
                                  f"on {optim!r}; it has none: set its \"optim\" to \"none\" or {remake}")
            if shard.trainable and optim == "none":
                raise ConfigError(f"{where} gives trainable shard {shard.name!r} no optimizer home (\"none\"); "
                                  f"use \"cpu\" or \"nvme\", or {remake}")
            # a pinned home keeps its pin: static_placement already put it on the pinned tier
            param_pinned = shard.pin is not None
            optim_pinned = shard.trainable and self._optim_pins.tier_for_param(shard.members[0].name) is not None
            for state, tier, pinned, section in (("param", param, param_pinned, "offload_param"),
                                                 ("optim", optim, optim_pinned, "offload_optimizer")):
                if pinned and tier != getattr(default, state):
                    raise ConfigError(
                        f"{where} puts the {state} home of shard {shard.name!r} on {tier!r}, but "
                        f"zero_optimization.{section}.module_parameters pins it to {getattr(default, state)!r}; "
                        f"remove that pin, or make the plan from a run with these pins (`zinf plan` keeps pinned homes)")
            out.append(ShardPlacement(param, optim))
        return out

    def _map_modules(self, model: nn.Module) -> dict[nn.Module, list[ShardState]]:
        """Module -> the shards of the parameters it directly owns (in first-member order)."""
        out: dict[nn.Module, list[ShardState]] = {}
        for mod in model.modules():
            seen: list[ShardState] = []
            for p in mod.parameters(recurse=False):
                st = self._member_of[id(p)][0]
                if st not in seen:
                    seen.append(st)
            if seen:
                out[mod] = seen
        return out

    def _nbytes(self, st: ShardState) -> tuple[int, int, int]:
        """(param bytes in compute dtype, optimizer group bytes, grad bytes) of a shard."""
        n = st.shard.numel
        param = n * self.dtype.itemsize
        if not st.shard.trainable:
            return param, 0, 0
        return param, n * 4 * (1 + len(self.optimizer.state_names)), n * 4

    def _aliases_master(self, st: ShardState, place: ShardPlacement | None = None) -> bool:
        """fp32 working copy and master in the same DRAM: one tensor serves both. ``place``:
        judge that placement instead of the shard's current one."""
        return self.sizing.aliases_master(st.shard.index, place or st.place)

    def _sizing(self) -> DramSizing:
        """This engine's DRAM arithmetic (:mod:`zinf.sizing`): every shard's bytes, the module
        tree's chains of shards, and the settings the overlap buffers depend on."""
        cfg = self.config
        shards = []
        for st in self.states:
            pb, ob, gb = self._nbytes(st)
            shards.append(ShardSizes(st.name, pb, ob, gb, st.shard.trainable, len(st.shard.members) > 1))
        chains = tuple((tuple(c.shard.index for c in chain), tuple(o.shard.index for o in own))
                       for chain, own in self._module_chains())
        return DramSizing(
            shards=tuple(shards), chains=chains, on_cpu=self.device.type == "cpu", fp32=self.dtype == torch.float32,
            staging_bytes=cfg.zinf.staging_buffers * cfg.zinf.staging_buffer_size,
            pipeline_write=cfg.zero_optimization.offload_optimizer.pipeline_write,
            pipeline_read=cfg.zero_optimization.offload_optimizer.pipeline_read,
            # (fp16: an update may run only once no gradient of the step overflowed, so none during backward)
            eager_wanted=cfg.zinf.overlap_optimizer and cfg.gradient_clipping == 0 and not cfg.fp16.enabled,
        )

    def _places(self) -> list[ShardPlacement]:
        """Every shard's current placement, in shard order (what :class:`DramSizing` asks about)."""
        return [st.place for st in self.states]

    def _dram_need(self, places: Sequence[ShardPlacement] | None = None) -> DramNeed:
        """The DRAM need of the current placement, or of ``places``."""
        return self.sizing.need(self._places() if places is None else places)

    def _live_param_bound(self) -> int:
        """Upper bound (bytes) of non-resident params materialised at the same time."""
        return self.sizing.live_param_bound(self._places())

    def _module_chains(self) -> list[tuple[tuple[ShardState, ...], tuple[ShardState, ...]]]:
        """Per module: the shards of it and its ancestors, and its own; computed once (the module
        tree does not change)."""
        chains = []
        for name, mod in self.module.named_modules():
            chain: set[ShardState] = set()
            parts = name.split(".") if name else []
            for depth in range(len(parts) + 1):
                anc = self.module.get_submodule(".".join(parts[:depth])) if depth else self.module
                chain.update(self._module_states.get(anc, []))
            chains.append((tuple(sorted(chain, key=lambda st: st.shard.index)), tuple(self._module_states.get(mod, []))))
        return chains

    def _largest_nvme_group_bytes(self) -> int:
        """Bytes of the largest optimizer group (master, moments, gradient) homed on NVMe."""
        return self.sizing.largest_nvme_group_bytes(self._places())

    def _size_overlap(self, budget_bytes: int | None) -> Overlap:
        """The overlap buffers the current placement gets under ``budget_bytes`` (see
        :meth:`DramSizing.overlap`), with the prefetch window asked for now."""
        return self.sizing.overlap(self._places(), budget_bytes, self._wanted_prefetch_bytes(), self.dram_need)

    def _new_prefetcher(self, stats=None) -> Prefetcher:
        """A prefetcher that records its trace in the next pass (``stats`` carried over, if given)."""
        elem_bytes = self.dtype.itemsize
        prefetcher = Prefetcher(self._start_param_read, self._param_read_bytes, self._discard_read,
                                window_bytes=self.overlap.prefetch_bytes,
                                reuse_distance_bytes=self.config.zero_optimization.stage3_max_reuse_distance * elem_bytes,
                                needs_read=lambda index: self.states[index].place.param == "nvme",
                                busy=lambda index: self.states[index].param_state is not ParamState.FREED)
        if stats is not None:
            prefetcher.stats = stats
        return prefetcher

    def _nvme_root(self, role: str) -> Path:
        """The swap directory configured for ``role`` ("param" or "optim")."""
        path = self.config.param_nvme_path if role == "param" else self.config.optim_nvme_path
        return Path(path).expanduser().absolute()

    def _open_store(self, role: str):
        """The NVMe store of ``role``, opened on first need (at start, or when a migration first
        puts a home of that role on NVMe); roles with the same directory share one store."""
        store = self._stores.get(role)
        if store is not None:
            return store
        from zinf.storage.nvme import NvmeStore

        cfg = self.config
        block_size, queue_depth, thread_count = self._aio_in_force()
        root = self._nvme_root(role)
        store = next((s for r, s in self._stores.items() if self._nvme_root(r) == root), None)
        if store is None:
            n_open = len({id(s) for s in self._stores.values()})
            store = NvmeStore(
                root,
                run_name=f"{self.run_name}-{n_open}" if n_open else self.run_name,
                block_size=block_size,
                queue_depth=queue_depth,
                thread_count=thread_count,
                pin_memory=self.device.type == "cuda",
                staging_bytes=cfg.zinf.staging_buffer_size,
                staging_count=cfg.zinf.staging_buffers,
                spare_bytes=self._spare_bytes(),
                listener=self._on_io if self.recorder.enabled else None,
            )
        self._stores[role] = store
        return store

    def _open_stores(self) -> None:
        for role in ("param", "optim"):
            if any(getattr(st.place, role) == "nvme" for st in self.states):
                self._open_store(role)
        needed = {"param": 0, "optim": 0}
        for st in self.states:
            pb, ob, gb = self._nbytes(st)
            if st.place.param == "nvme" and not self._param_file_is_master(st):
                needed["param"] += pb
            if st.place.optim == "nvme":
                needed["optim"] += ob + gb
        for role, store in self._stores.items():
            # Every file may briefly exist twice while it is being replaced (write-new, switch),
            # and retired versions are kept for reuse up to the spare pool's bytes.
            store.check_space(needed[role] + self._spare_bytes()
                              + max(self._nbytes(st)[0] + self._nbytes(st)[1] for st in self.states))

    def _spare_bytes(self) -> int:
        """Disk for retired swap files kept for reuse (see zinf.storage.nvme.SparePool): room for
        a few of the largest, at most a quarter of the swap state beyond that, 256 MiB at most."""
        largest = max((sum(self._nbytes(st)) for st in self.states), default=0)
        swap = sum(sum(self._nbytes(st)) for st in self.states if "nvme" in (st.place.param, st.place.optim))
        return max(4 * largest, min(256 << 20, swap // 4))

    def _param_file_is_master(self, st: ShardState, place: ShardPlacement | None = None) -> bool:
        """fp32 working copy and fp32 master both on NVMe, in one store: one file serves both.
        ``place``: judge that placement instead of the shard's current one."""
        place = place or st.place
        return (
            st.shard.trainable
            and self.dtype == torch.float32
            and place.param == "nvme"
            and place.optim == "nvme"
            and self._nvme_root("param") == self._nvme_root("optim")
        )

    def _param_key(self, st: ShardState) -> str:
        return st.key("master") if self._param_file_is_master(st) else st.key("param")

    @property
    def o_direct(self) -> bool:
        """False when some NVMe store fell back to buffered I/O (the filesystem refused O_DIRECT)."""
        return all(s.o_direct for s in self._stores.values())

    def _home_all(self) -> None:
        """Copy every parameter into its shard's homes, then point the model at them."""
        for st in self.states:
            shard = st.shard
            flat = torch.empty(shard.numel, dtype=torch.float32)
            for m in shard.members:
                flat[m.offset : m.offset + m.numel].copy_(m.param.detach().reshape(-1))
            # optimizer home: fp32 master
            if shard.trainable:
                if st.place.optim == "nvme":
                    self._stores["optim"].write(st.key("master"), flat)
                else:
                    # The update runs on the CPU (gradients are offloaded there as they arrive), so
                    # a "gpu" optimizer home keeps its master in DRAM too.
                    st.master = flat
            # param home: working copy in the compute dtype
            if self._aliases_master(st):
                st.master = self._host_param_home(st.master)  # with CUDA uploads read it: page-locked
                st.param_home = st.master
            elif st.place.param == "nvme":
                if not self._param_file_is_master(st):
                    self._stores["param"].write(st.key("param"), flat.to(self.dtype))
            else:
                home = flat.to(self.dtype) if self.dtype != torch.float32 else flat.clone()
                st.param_home = home.to(self.device) if st.place.param == "gpu" else self._host_param_home(home)
            self._point_params(st)
            del flat

    def _host_param_home(self, t: Tensor) -> Tensor:
        """A DRAM param home: page-locked with CUDA, so that uploads from it are asynchronous DMA
        (pageable memory would be copied through a driver buffer, blocking the training thread)."""
        return t.pin_memory() if self._cuda is not None and not t.is_pinned() else t

    def _point_params(self, st: ShardState) -> None:
        """Make the model's parameters of ``st`` views of its param home when that home is on
        the compute device (resident), else empty tensors refilled at each use (freed)."""
        resident = st.place.param == "gpu" or (st.place.param == "cpu" and self.device.type == "cpu")
        for m in st.shard.members:
            if resident:
                m.param.data = st.param_home[m.offset : m.offset + m.numel].view(m.shape)
            else:
                m.param.data = torch.empty(m.shape, dtype=self.dtype, device=self.device)
                m.param.untyped_storage().resize_(0)
        st.param_state = ParamState.RESIDENT if resident else ParamState.FREED

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self, model: nn.Module) -> list:
        handles = []
        for mod, states in self._module_states.items():
            handles.append(mod.register_forward_pre_hook(self._make_pre_forward(states)))
            handles.append(mod.register_forward_hook(self._make_post_forward(states)))
            handles.append(mod.register_full_backward_pre_hook(self._make_pre_backward(states)))
            handles.append(mod.register_full_backward_hook(self._make_post_backward(states)))
        for st in self.states:
            for i, m in enumerate(st.shard.members):
                if m.trainable:
                    handles.append(m.param.register_post_accumulate_grad_hook(self._make_grad_hook(st, i)))
        return handles

    def _make_pre_forward(self, states: list[ShardState]):
        def hook(module, args):
            phase = "recompute" if self._in_backward else "forward"
            if phase == "recompute":
                self._recomputes = True  # backward fetches for recomputed forwards too
            for st in states:
                if phase == "forward":
                    self._forward_order.setdefault(st.shard.index, st)
                self._acquire(st, phase)
                if phase == "recompute":
                    self._recompute_held.append(st)

        return hook

    def _make_post_forward(self, states: list[ShardState]):
        def hook(module, args, output):
            for st in states:
                if self._in_backward and st in self._recompute_held:
                    self._recompute_held.remove(st)
                self._release(st)

        return hook

    def _make_pre_backward(self, states: list[ShardState]):
        def hook(module, grad_output):
            for st in states:
                self._acquire(st, "backward")
                self._backward_held.append(st)
                if st.grad_on_nvme and st.grad is None and st.grad_read is None:
                    self._start_grad_sum_read(st)
                    self.grad_reads_ahead += 1
                if self.overlap.eager and len(st.shard.members) == 1 and st.place.optim == "nvme" \
                        and st.group_reads is None and st.shard.trainable and self._last_micro_batch():
                    # its update will run as soon as its gradient is final: read its optimizer
                    # group now, while the module's backward computes
                    st.group_reads = self._read_group_async(st, with_grad=False)
            if self._backward_queue:
                self._read_group_ahead(states)

        return hook

    def _start_grad_sum_read(self, st: ShardState) -> None:
        """Start reading back the gradient sum that earlier micro-batches of this window left in
        ``st``'s file, into a fresh accumulator the gradient then adds to (:meth:`_accumulate_grad`).
        Started from the module's backward pre-hook, the read runs while the module's backward
        computes; read on arrival instead, every micro-batch after the first waited for its sums
        one by one (the dense GPT with accumulation 4 at 30%: 102 reads a step). A gradient that
        arrives with no read started (no pre-hook of its module ran) starts it then."""
        n = st.shard.numel
        # 4096-aligned: read straight into it (O_DIRECT), as the accumulator it becomes
        out = aligned_empty(n * 4).view(torch.float32)[:n]
        st.grad_read = self._stores["optim"].read_async(st.key("grad"), out)
        self._count("read", "nvme", n * 4)

    def _plan_backward_reads(self) -> None:
        """Before a backward whose updates run during it: the NVMe optimizer groups it will update,
        in the order it will reach them (this pass's forward order, reversed), when the engine
        was granted a read-ahead of a group (``overlap.read_ahead_bytes``, otherwise the
        optimizer phase's, which updates during backward leave idle)."""
        self._backward_queue, self._backward_pos, self._backward_updated = [], {}, set()
        self._read_ahead_st = None
        if not (self.overlap.eager and self.overlap.read_ahead_bytes > 0 and self._last_micro_batch()):
            return
        self._backward_queue = [st for st in reversed(self._forward_order.values())
                                if st.place.optim == "nvme" and st.shard.trainable and len(st.shard.members) == 1]
        self._backward_pos = {st.shard.index: k for k, st in enumerate(self._backward_queue)}

    def _read_group_ahead(self, states: list[ShardState]) -> None:
        """Backward reached the module of ``states``: start reading the optimizer group of the next
        NVMe shard backward will update after them, one group ahead at most, if it fits the
        read-ahead granted. On the skewed MoE (16 tokens a step) a module's own backward is too
        short to hide its group's read behind: the update waited for it."""
        ahead = self._read_ahead_st
        if ahead is not None and ahead.group_reads is not None:
            return  # the group read ahead is still waiting for its module
        here = max((self._backward_pos.get(st.shard.index, -1) for st in states), default=-1)
        if here < 0:
            return
        for nxt in self._backward_queue[here + 1:]:
            if nxt.group_reads is not None or nxt.shard.index in self._backward_updated:
                continue  # read already (its module's own hook, or out of order), or updated
            if len(self._group_names(nxt, with_grad=False)) * nxt.shard.numel * 4 <= self.overlap.read_ahead_bytes:
                nxt.group_reads = self._read_group_async(nxt, with_grad=False)
                self._read_ahead_st = nxt
                self.backward_reads_ahead += 1
            return

    def _make_post_backward(self, states: list[ShardState]):
        def hook(module, grad_input, grad_output):
            # When none of the module's inputs needs a gradient, torch calls this hook *before*
            # the module's backward has run; the end of backward releases those shards instead.
            if all(g is None for g in grad_input):
                return
            for st in states:
                if st in self._backward_held:
                    self._backward_held.remove(st)
                    self._release(st)

        return hook

    def _make_grad_hook(self, st: ShardState, i: int):
        def hook(param: Tensor) -> None:
            self._take_grad(st, i, param)

        return hook

    # ------------------------------------------------------------------ fetch / release
    def _acquire(self, st: ShardState, phase: str) -> None:
        if st.param_state is ParamState.RESIDENT:
            if self._emit_detail:
                self._emit_fetch(st, phase, st.place.param, 0, 0.0, 0.0)
            return
        st.refcount += 1
        if st.param_state is ParamState.PREFETCHED:
            self._use_prefetched(st, phase)
            return
        if st.param_state is ParamState.MATERIALISED:
            if st.refcount == 1 and st.shard.index in self._prefetcher.kept:
                self._prefetcher.reuse(st.shard.index)  # kept since its last use: no read
            if self._emit_detail:
                # Still here (kept, held for the pass like a chunk, or in use by another module):
                # an access that moves nothing, counted like one of a resident shard, so that a
                # shard's accesses per step do not depend on its tier.
                self._emit_fetch(st, phase, st.place.param, 0, 0.0, 0.0)
            return
        t0 = time.perf_counter()
        shard = st.shard
        nbytes = self._nbytes(st)[0]
        read_wait_s = 0.0  # of the stall: waiting for the read (the rest no prefetch can hide)
        with span(f"zinf.fetch.{st.place.param}"):
            if st.place.param == "nvme":
                entry = self._prefetcher.take(shard.index)
                if entry is None:  # a miss: the read goes before anything queued not waited for
                    future = self._start_param_read(shard.index, urgent=True)
                else:
                    future = entry.future
                    self._stores["param"].hurry(future)  # queued behind others still: not now
                t_wait = time.perf_counter()
                try:
                    src = future.result()  # waits only for what the prefetch did not bring in time
                finally:
                    buffer = future.zinf_buffer
                now = time.perf_counter()
                read_wait_s = now - (t0 if entry is None else t_wait)  # a miss: issuing it is waiting too
                landed = entry.done_at_s[0] if entry is not None and entry.done_at_s else now
                fetch_s = landed - (entry.issued_at_s if entry is not None else t0)
            else:
                if self._cuda is not None:
                    self._prefetcher.take(shard.index)  # DRAM homes are in the trace too: uploads follow it
                src, buffer = st.param_home, None
            self._fill(st, src, buffer, wait=True)
        st.param_state = ParamState.MATERIALISED
        stall_s = time.perf_counter() - t0
        if st.place.param != "nvme":
            fetch_s = stall_s
        self._count("read", st.place.param, nbytes)
        self._step_timer.stall_s += stall_s
        if self._emit_detail:
            self._emit_fetch(st, phase, st.place.param, nbytes, fetch_s, stall_s, max(0.0, stall_s - read_wait_s))
        if self._cuda is not None:
            self._upload_ahead()

    def _fill(self, st: ShardState, src: Tensor, buffer: Tensor | None, wait: bool) -> None:
        """Give the shard's param tensors storage again and copy ``src`` (its flat param home, or
        a pooled read of its file; ``buffer`` goes back to the pool when the copy is done). On the
        CPU the copy is done on return. With CUDA it is an upload on the side stream: ``wait``
        makes the compute stream wait for it now, else its event waits in ``st.upload_event``."""
        for m in st.shard.members:
            m.param.untyped_storage().resize_(m.numel * m.param.element_size())
        pairs = [(m.param.data, src[m.offset : m.offset + m.numel].view(m.shape)) for m in st.shard.members]
        if self._cuda is None:
            for dst, part in pairs:
                dst.copy_(part)
            if buffer is not None:
                self._buffers.put(buffer)
            return
        event = self._cuda.upload(pairs)
        if buffer is not None:
            self._cuda.after(event, lambda: self._buffers.put(buffer))
        if wait:
            self._cuda.use(event)
        else:
            st.upload_event = event

    def _upload_ahead(self) -> None:
        """(CUDA) Issue the uploads of the shards that come next along the trace, up to
        :meth:`_upload_ahead_bytes` of them not used yet, so that they overlap the compute of the
        modules before them. A shard on NVMe goes once its read has landed (uploads stay in
        trace order: the first whose read is still in flight stops the walk)."""
        pf = self._prefetcher
        if pf.recording:
            return
        room = self._upload_ahead_bytes() - sum(self._nbytes(st)[0] for st in self._prefetched)
        for j in range(pf.pos, len(pf.trace)):
            st = self.states[pf.trace[j]]
            if st.param_state is not ParamState.FREED or not pf.likely(st.shard.index):
                continue  # in use, kept, already uploaded, or seldom used by recent passes
            nbytes = self._nbytes(st)[0]
            if nbytes > room:
                return
            if st.place.param == "nvme":
                entry = pf.in_flight.get(st.shard.index)
                if entry is None or not entry.future.done():
                    return
                pf.claim(st.shard.index)
                src, buffer = entry.future.result(), entry.future.zinf_buffer
            else:
                src, buffer = st.param_home, None
            self._fill(st, src, buffer, wait=False)
            st.param_state = ParamState.PREFETCHED
            self._prefetched.add(st)
            room -= nbytes

    def will_use(self, modules: Iterable[nn.Module]) -> None:
        """The model is about to run ``modules`` (and their submodules), in this order, in this
        forward: read their parameter shards on NVMe ahead now (``zinf.will_use``; ignored with
        ``zinf.prefetch_hints`` off, while the trace is recorded, and outside a forward)."""
        if self._closed or not self.config.zinf.prefetch_hints:
            return
        shards: dict[int, None] = {}  # ordered, distinct
        for module in modules:
            for p in module.parameters():
                member = self._member_of.get(id(p))
                if member is not None:
                    shards[member[0].shard.index] = None
        self._prefetcher.hint(list(shards))

    def _use_prefetched(self, st: ShardState, phase: str) -> None:
        """(CUDA) First use of a shard uploaded ahead: the compute stream waits for its upload
        (the training thread does not), and the trace moves on."""
        self._prefetched.discard(st)
        self._prefetcher.take(st.shard.index)  # its read, if any, was claimed: counted as a hit
        self._cuda.use(st.upload_event)
        st.upload_event = None
        st.param_state = ParamState.MATERIALISED
        nbytes = self._nbytes(st)[0]
        self._count("read", st.place.param, nbytes)
        if self._emit_detail:
            self._emit_fetch(st, phase, st.place.param, nbytes, 0.0, 0.0)
        self._upload_ahead()

    def _param_read_bytes(self, index: int) -> int:
        return self._nbytes(self.states[index])[0]

    def _start_param_read(self, index: int, urgent: bool = False) -> Future:
        """Start reading shard ``index``'s param file into a pooled aligned buffer (``urgent``:
        the training thread waits for it now). The future resolves to the flat tensor (compute
        dtype); ``future.zinf_buffer`` is the raw buffer, which whoever consumes the future
        gives back to the pool."""
        st = self.states[index]
        nbytes = self._nbytes(st)[0]
        buffer = self._buffers.get(nbytes)
        out = buffer[:nbytes].view(self.dtype)
        future = self._stores["param"].read_async(self._param_key(st), out, urgent=urgent)
        future.zinf_buffer = buffer
        return future

    def _discard_read(self, future: Future) -> None:
        """A prefetch that will not be used: its buffer goes back to the pool once it lands."""
        future.add_done_callback(lambda f: self._buffers.put(f.zinf_buffer))

    def _release(self, st: ShardState) -> None:
        if st.param_state is ParamState.RESIDENT:
            return
        st.refcount -= 1
        if st.refcount > 0:
            return
        st.refcount = 0
        if len(st.shard.members) > 1 and (self._in_backward or torch.is_grad_enabled()):
            # A chunk of small parameters serves many modules, one after another: it stays for
            # the whole pass (counted in the working set), instead of one read per module.
            self._pass_held.add(st)
            return
        if st.place.param == "nvme" and self._prefetcher.keep(st.shard.index):
            return  # needed again soon: stays materialised (counted in the prefetch window)
        self._free(st)

    def _free(self, st: ShardState) -> None:
        if st.upload_event is not None:  # uploaded ahead, never used: the copy must land before
            self._cuda.use(st.upload_event)  # the compute stream may reuse its memory
            st.upload_event = None
        for m in st.shard.members:
            m.param.untyped_storage().resize_(0)
        st.param_state = ParamState.FREED

    def _free_kept(self) -> None:
        """Free the shards kept materialised for reuse (the pass is over, or params change)."""
        held, self._pass_held = self._pass_held, set()
        for st in held:
            if st.refcount == 0 and st.param_state is ParamState.MATERIALISED:
                self._free(st)
        for index in self._prefetcher.pop_kept():
            st = self.states[index]
            if st.refcount == 0 and st.param_state is ParamState.MATERIALISED:
                self._free(st)
        prefetched, self._prefetched = self._prefetched, set()
        for st in prefetched:  # uploaded ahead for a use that did not come (the trace diverged)
            self._free(st)

    # ------------------------------------------------------------------ gradients
    def _take_grad(self, st: ShardState, i: int, param: Tensor) -> None:
        """A gradient is final: it leaves the compute device now (into the shard's fp32
        accumulator; with CUDA first into a pinned buffer, downloaded on the side stream)."""
        g = param.grad
        param.grad = None
        if g is None:
            return
        if self._cuda is not None and g.device.type == "cuda":
            self._download_grad(st, i, g)
        else:
            self._accumulate_grad(st, i, g)

    def _download_grad(self, st: ShardState, i: int, g: Tensor) -> None:
        """(CUDA) Start copying gradient ``g`` of member ``i`` to a pinned buffer on the side
        stream; it is accumulated once the copy has landed (:meth:`_land_grads`). Downloads in
        flight are capped (``_grad_download_cap``) so that pinned memory stays bounded."""
        nbytes = g.numel() * g.element_size()
        buffer = self._buffers.get(nbytes)
        host = buffer[:nbytes].view(g.dtype)
        event = self._cuda.download(g.reshape(-1), host)
        self._pending_grads.append((event, st, i, host, buffer))
        self._pending_grad_bytes += buffer.numel()
        self._land_grads()

    def _grad_download_cap(self) -> int:
        """Bytes of gradient downloads that may be in flight (their device copies wait on the GPU
        until the copy is done): two of the largest shard, at least 16 MiB (0.3 ms of copy at
        50 GB/s: enough to keep the copy engine busy)."""
        return self._grad_cap_bytes

    def _land_grads(self, block: bool = False) -> None:
        """(CUDA) Accumulate the downloaded gradients whose copies have finished, in the order
        they were issued; with ``block`` (end of backward) wait for all of them, and also wait
        while more than :meth:`_grad_download_cap` bytes are in flight."""
        cap = self._grad_download_cap()
        while self._pending_grads:
            event, st, i, host, buffer = self._pending_grads[0]
            if not (block or self._pending_grad_bytes > cap or event.query()):
                return
            self._pending_grads.popleft()
            t0 = time.perf_counter()
            event.synchronize()
            self._step_timer.stall_s += time.perf_counter() - t0
            self._pending_grad_bytes -= buffer.numel()
            m = st.shard.members[i]
            self._accumulate_grad(st, i, host.view(m.shape))
            self._buffers.put(buffer)

    def _accumulate_grad(self, st: ShardState, i: int, g: Tensor) -> None:
        """Add gradient ``g`` (on the CPU) of member ``i`` into the shard's fp32 accumulator; an
        NVMe shard's accumulator is then written out, or the shard updated at once."""
        m = st.shard.members[i]
        with span("zinf.grad.offload"):
            if st.grad is None and st.grad_buffer is not None:
                st.grad = st.grad_buffer  # a DRAM optimizer home keeps its accumulator between steps
            elif st.grad is None and st.grad_on_nvme:  # earlier micro-batches left their sum on NVMe
                if st.grad_read is None:
                    self._start_grad_sum_read(st)
                future, st.grad_read = st.grad_read, None
                t0 = time.perf_counter()
                self._stores["optim"].hurry(future)  # waited for now: before what is only read ahead
                st.grad = future.result()
                waited = time.perf_counter() - t0
                self._step_timer.stall_s += waited
                if self._emit_detail:
                    self._emit_transfer(st, "grad", "read", "nvme", st.shard.numel * 4, waited)
            elif st.grad is None:
                # 4096-aligned: an NVMe gradient file is then written and read straight from
                # and into it (O_DIRECT), not through a staging copy
                st.grad = aligned_empty(st.shard.numel * 4).view(torch.float32)[: st.shard.numel]
                if st.place.optim != "nvme":  # fresh pages cost a page fault each: reuse them
                    st.grad_buffer = st.grad
            view = st.grad[m.offset : m.offset + m.numel].view(m.shape)
            g = g.to("cpu") if g.device.type != "cpu" else g
            if i in st.grad_members:
                view.add_(g)  # in fp32 whatever g's dtype (type promotion), no fp32 copy of g
            else:
                view.copy_(g)
            st.grad_members.add(i)
            st.arrived_now.add(i)
            if len(st.shard.members) == 1:  # its gradient is complete (a chunk's at the end of backward)
                self._grad_complete(st)

    def _grad_complete(self, st: ShardState) -> None:
        """The shard's gradient of this backward is complete: at the last micro-batch update the
        shard now (during backward) where that is on, else write an NVMe home's accumulator out."""
        if st.place.optim == "nvme":
            if self.overlap.eager and self._last_micro_batch():
                self._update_during_backward(st)
            else:
                self._spill_grad(st)
        elif self._eager_dram and self._last_micro_batch():
            self._update_during_backward(st)

    def _last_micro_batch(self) -> bool:
        """Whether the backward running now ends a gradient-accumulation window."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def _update_during_backward(self, st: ShardState) -> None:
        """Clipping is off and this shard's gradient is final: update it now, on the optimizer
        worker, while backward goes on. Waits (a stall) when two updates are already queued."""
        st.arrived_now.clear()
        self._backward_updated.add(st.shard.index)
        group, st.group_reads = st.group_reads, None
        if st.place.optim != "nvme":
            group = None  # DRAM homes: nothing to read
        elif group is None or (st.grad is None and "grad" not in group):
            group = self._read_group_async(st)
        if group is None:  # a DRAM home: nothing to bound, the training thread never waits for it
            self._eager_dram_futures.append(self._eager.submit(self._update_shard, st, None, None))
            return
        while len(self._eager_futures) >= 2:
            t0 = time.perf_counter()
            self._eager_futures.pop(0).result()
            self._step_timer.stall_s += time.perf_counter() - t0
        self._eager_futures.append(self._eager.submit(self._update_shard, st, None, group))

    def _spill_grad(self, st: ShardState) -> None:
        """Write an NVMe shard's accumulated gradient to its file (after noting its norms)."""
        for i in st.arrived_now:
            m = st.shard.members[i]
            st.grad_norms[i] = torch.linalg.vector_norm(st.grad[m.offset : m.offset + m.numel], 2.0)
        st.arrived_now.clear()
        grad, st.grad = st.grad, None
        # behind backward, through the window of writes in flight; what the training thread waits
        # here (a synchronous write without a window, or room in a full one) is a stall, so that
        # compute = phase time - stall holds no I/O
        t0 = time.perf_counter()
        self._write_optim(st, "grad", grad)
        waited = time.perf_counter() - t0
        self._step_timer.stall_s += waited
        st.grad_on_nvme = True
        if self._emit_detail:
            self._emit_transfer(st, "grad", "write", "nvme", grad.numel() * 4, waited)

    def _finish_backward(self) -> None:
        if self._cuda is not None:
            self._land_grads(block=True)
        for st in self._backward_held + self._recompute_held:
            self._release(st)
        self._backward_held, self._recompute_held = [], []
        for st in self.states:
            # gradients that arrived and are not handled yet (chunks wait for the end of backward)
            if st.arrived_now:
                self._grad_complete(st)
            st.arrived_now.clear()
            # a sum read back for a module none of whose parameters got a gradient this time:
            # dropped (its file still holds it; the buffer is no pooled one)
            st.grad_read = None
        for st in self._backward_queue:  # groups read for a module whose backward never came
            self._discard_group_reads(st)
        self._backward_queue, self._backward_pos, self._read_ahead_st = [], {}, None
        self._free_kept()
        self._prefetcher.end_recording()
        # The next pass may start reading now, unless an optimizer step comes first: it
        # rewrites the parameters, and a read issued before that would see the old values.
        if not self._last_micro_batch():
            self._prefetcher.begin_pass()
            self._pass_open = "fresh"
        else:
            self._pass_open = False

    # ------------------------------------------------------------------ NVMe helpers
    def _count(self, op: str, tier: str, nbytes: int) -> None:
        with self._stats_lock:
            (self._stats.read if op == "read" else self._stats.written)[tier] += nbytes

    def _write_optim(self, st: ShardState, what: str, t: Tensor, buffer: Tensor | None = None) -> None:
        """Write ``t`` to the shard's ``what`` file: through the window of writes in flight when
        there is one (``buffer``, if given, goes back to the pool when the write is done)."""
        self._write(self._stores["optim"], st.key(what), t, buffer)

    def _write(self, store, key: str, t: Tensor, buffer: Tensor | None = None) -> None:
        nbytes = t.numel() * t.element_size()
        self._count("write", "nvme", nbytes)
        if self._writes.cap_bytes == 0:
            store.write(key, t)
            if buffer is not None:
                self._buffers.put(buffer)
            return
        self._writes.reserve(nbytes)
        future = store.write_async(key, t)
        self._writes.track(future, nbytes, on_done=(lambda: self._buffers.put(buffer)) if buffer is not None else None)

    def _group_names(self, st: ShardState, with_grad: bool = True) -> list[str]:
        """The files of an NVMe shard's optimizer group a read takes: the master, the moments
        (once they exist) and the gradient (when it waits on NVMe and ``with_grad``)."""
        names = ["master", *(self.optimizer.state_names if st.has_moments else ())]
        if st.grad is None and with_grad:
            names.append("grad")
        return names

    def _discard_group_reads(self, st: ShardState) -> None:
        """Give back the optimizer group read for ``st`` that no update will use (if any)."""
        if st.group_reads is not None:
            for future in st.group_reads.values():
                self._discard_read(future)
            st.group_reads = None

    def _read_group_async(self, st: ShardState, with_grad: bool = True) -> dict[str, Future]:
        """Start reading an NVMe shard's optimizer group into pooled buffers: the master, the
        moments (once they exist) and the gradient (when it waits on NVMe and ``with_grad``)."""
        n = st.shard.numel
        store = self._stores["optim"]
        group: dict[str, Future] = {}
        for name in self._group_names(st, with_grad):
            buffer = self._buffers.get(n * 4)
            future = store.read_async(st.key(name), buffer[: n * 4].view(torch.float32))
            future.zinf_buffer = buffer
            group[name] = future
            self._count("read", "nvme", n * 4)
        return group

    def _on_io(self, op: str, key: str, nbytes: int, seconds: float, concurrency: float = 1.0) -> None:
        """The stores' listener, on whatever thread finished the request: one tuple appended
        (deque appends and pops are atomic), sent to the recorder in a batch by :meth:`_emit_io`."""
        if self._run_started:
            self._io_log.append((op, key, nbytes, seconds, concurrency))

    def _emit_io(self) -> None:
        """Send the requests finished since the last batch, with the I/O settings they ran with
        (called at the end of every step, before the settings change, and at the end)."""
        log_ = self._io_log
        if not self._emit_detail:  # a step the recorder does not sample: its requests are not sent
            for _ in range(len(log_)):
                log_.popleft()
            return
        rows = []
        for _ in range(len(log_)):  # what lands meanwhile stays for the next batch
            op, key, nbytes, seconds, concurrency = log_.popleft()
            index, _, what = key.partition(".")
            rows.append((op, what, self.shards[int(index)].name, nbytes, seconds, concurrency))
        if rows:
            self.recorder.emit(ev.IoBatch(tuple(rows), "nvme", self.o_direct, *self._aio_in_force()))

    # ------------------------------------------------------------------ public API
    def __call__(self, *args, **kwargs):
        self._check_open()
        if not self._step_timer.running:
            self._step_timer.start()
        if self._prefetcher.recording and self._prefetcher.trace and not self._in_backward:
            self._prefetcher.end_recording()  # a forward-only pass (evaluation) came before
        if not self._in_backward:
            self._forward_order = {}  # the modules this pass runs, in order (the backward's reads)
        if self._pass_open != "fresh" and not self._in_backward:
            self._free_kept()
            self._prefetcher.begin_pass()
        self._pass_open = True
        if torch.is_grad_enabled():
            self._window_open = True  # a backward may follow: no migration until the step ends
        if self._cuda is not None:  # inputs on the CPU go to the compute device, like the params
            args, kwargs = tree_map_only(
                Tensor, lambda t: t.to(self.device, non_blocking=True) if t.device.type == "cpu" else t, (args, kwargs))
        t0 = time.perf_counter()
        with span("zinf.forward"):
            out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            self._free_kept()  # evaluation: no backward follows that could reuse them
        self._step_timer.forward_s += time.perf_counter() - t0
        return out

    forward = __call__

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` scaled by 1/gradient_accumulation_steps, as DeepSpeed does."""
        self._check_open()
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ModelError("engine.backward needs the scalar loss tensor returned by the forward")
        self._losses.append(float(loss.detach()))
        self._window_open = True
        t0 = time.perf_counter()
        scaled = loss / self.gradient_accumulation_steps if self.gradient_accumulation_steps > 1 else loss
        if self.loss_scaler is not None:
            # fp16: keep small gradients from underflowing. In fp32, as torch's GradScaler does: the
            # scaled loss itself would overflow fp16 long before the gradients do.
            scaled = scaled.float() * self.loss_scaler.scale
        self._backward_held = []
        self._plan_backward_reads()
        if not self._recomputes:
            self._prefetcher.begin_backward()  # prefetch what this forward used, in reverse
        self._in_backward = True
        try:
            with span("zinf.backward"), warnings.catch_warnings():
                # A module none of whose inputs needs a gradient (the first layer, an embedding)
                # gets its full-backward hook early; _make_post_backward handles that case.
                warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")
                scaled.backward()
        finally:
            self._in_backward = False
            self._finish_backward()
        self._step_timer.backward_s += time.perf_counter() - t0

    def step(self) -> None:
        """Call after every micro-batch; updates parameters at the accumulation boundary."""
        self._check_open()
        self.micro_steps += 1
        if self.micro_steps % self.gradient_accumulation_steps != 0:
            return
        t0 = time.perf_counter()
        with span("zinf.optimizer"):
            self._optimizer_phase()
        self._step_timer.optimizer_s += time.perf_counter() - t0
        self.global_steps += 1
        self._window_open = False
        migration_s = self._consult_controller() if self.controller is not None else 0.0
        self._end_step(migration_s)
        # The parameters are final for the next step: its first reads may start now (they
        # queue behind the write-backs of the same files).
        self._prefetcher.begin_pass()
        self._pass_open = "fresh"

    def _optimizer_phase(self) -> None:
        # no parameter read in flight may cross the update (it would see the old values)
        self._prefetcher.cancel()
        self._free_kept()
        if self._cuda is not None:
            self._cuda.synchronize()  # no upload may still read a param home the update rewrites
        self._wait_updates_during_backward()
        states = [st for st in self.states if st.grad_members]
        coef = None
        scaler = self.loss_scaler
        if (self.config.gradient_clipping > 0 or scaler is not None) and states:
            norms: list[tuple[int, Tensor]] = []
            for st in states:
                for i in st.grad_members:
                    m = st.shard.members[i]
                    if i not in st.grad_norms:  # gradient still in DRAM
                        st.grad_norms[i] = torch.linalg.vector_norm(st.grad[m.offset : m.offset + m.numel], 2.0)
                    norms.append((m.index, st.grad_norms[i]))
            norms.sort(key=lambda x: x[0])  # model order, as clip_grad_norm_ stacks them
            if scaler is not None:
                if not all(bool(torch.isfinite(n)) for _, n in norms):
                    self._skip_overflowed_step(states)
                    return
                # unscale: 1/scale is a power of two, so scaling norms and gradients is exact
                unscale = 1.0 / scaler.scale
                norms = [(k, n * unscale) for k, n in norms]
                coef = torch.tensor(unscale)
            if self.config.gradient_clipping > 0:
                clip = clip_coefficient([n for _, n in norms], self.config.gradient_clipping)
                coef = clip if coef is None else clip * coef
        # Pipelined over NVMe groups: the next group's read is in flight while this one is
        # updated, and write-backs run behind (self._writes) while later groups go on.
        read_ahead = self.overlap.read_ahead_bytes > 0
        reads: dict[int, dict[str, Future]] = {}
        nvme_states = [st for st in states if st.place.optim == "nvme"]
        upcoming = iter(nvme_states)
        for st in states:
            if st.place.optim == "nvme":
                if st.shard.index not in reads:
                    nxt = next(upcoming)
                    assert nxt is st, "NVMe groups are read in the order they are updated"
                    reads[nxt.shard.index] = self._read_group_async(nxt)
                if read_ahead:
                    nxt = next(upcoming, None)
                    if nxt is not None:
                        reads[nxt.shard.index] = self._read_group_async(nxt)
            self._update_shard(st, coef, reads.pop(st.shard.index, None))
        if scaler is not None:
            scaler.update(overflow=False)

    def _skip_overflowed_step(self, states: list[ShardState]) -> None:
        """fp16: some gradient is inf or NaN (the loss scale is too large). Drop this window's
        gradients without touching parameters or optimizer state, and let the scale shrink."""
        for st in states:
            if st.grad_on_nvme:
                self._stores["optim"].delete(st.key("grad"))
            st.grad = None
            st.grad_on_nvme = False
            st.grad_members = set()
            st.grad_norms = {}
        self.skipped_steps += 1
        before = self.loss_scaler.scale
        self.loss_scaler.update(overflow=True)
        log.info("fp16 gradient overflow at step %d: update skipped, loss scale %g -> %g",
                 self.global_steps + 1, before, self.loss_scaler.scale)

    def _optimizer_worker(self) -> ThreadPoolExecutor:
        """The thread that runs updates during backward. With the CPU as the compute device the
        training thread's OpenMP team has the cores, so the worker's updates stay on the worker
        (a second team slows every step: zinf.threads); with a GPU the CPU is the worker's."""
        init = single_threaded_torch if self.device.type == "cpu" else None
        return ThreadPoolExecutor(1, thread_name_prefix="zinf-optim", initializer=init)

    def _wait_updates_during_backward(self) -> None:
        futures, self._eager_futures = self._eager_futures + self._eager_dram_futures, []
        self._eager_dram_futures = []
        for f in futures:
            f.result()

    def _update_shard(self, st: ShardState, coef: Tensor | None, group: dict[str, Future] | None) -> None:
        """Clip (``coef``) and update the members of ``st`` that got a gradient, then write the
        group back and refresh the param home. ``group``: the reads of an NVMe group, started
        by :meth:`_read_group_async`. Runs on the optimizer worker for updates during backward."""
        shard, opt = st.shard, self.optimizer
        t0 = time.perf_counter()
        read_bytes = write_bytes = 0
        on_nvme = st.place.optim == "nvme"
        buffers: dict[str, Tensor] = {}
        with span(f"zinf.optimizer.read.{st.place.optim}"):
            if on_nvme:
                loaded = {}
                store = self._stores["optim"]
                for future in group.values():  # waited for now: before what is only read ahead
                    store.hurry(future)
                for name, future in group.items():
                    buffers[name] = future.zinf_buffer
                    loaded[name] = future.result()
                    read_bytes += shard.numel * 4
                master = loaded["master"]
                moments = {}
                for name in opt.state_names:
                    if name in loaded:  # read because they existed when the reads were asked for
                        moments[name] = loaded[name]
                    else:
                        buffers[name] = self._buffers.get(shard.numel * 4)
                        moments[name] = buffers[name][: shard.numel * 4].view(torch.float32).zero_()
                if st.grad is None:
                    st.grad = loaded["grad"]
            else:
                master = st.master
                if not st.has_moments:
                    st.moments = {name: torch.zeros_like(master) for name in opt.state_names}
                moments = st.moments
        t1 = time.perf_counter()
        with span("zinf.optimizer.update"):
            for i in sorted(st.grad_members):
                m = shard.members[i]
                sl = slice(m.offset, m.offset + m.numel)
                g = st.grad[sl]
                if coef is not None:
                    g.mul_(coef)
                st.steps[i] += 1
                opt.update(master[sl], g, {k: v[sl] for k, v in moments.items()}, st.steps[i])
        st.has_moments = True
        t2 = time.perf_counter()
        with span(f"zinf.optimizer.write.{st.place.optim}"):
            self._refresh_param_home(st, master)  # before the write-back hands master's buffer on
            if on_nvme:
                if "grad" in buffers:  # the gradient was read into a pooled buffer: done with it
                    self._buffers.put(buffers.pop("grad"))
                self._write_optim(st, "master", master, buffers.pop("master"))
                for name, t in moments.items():
                    self._write_optim(st, name, t, buffers.pop(name))
                if st.grad_on_nvme:
                    self._stores["optim"].delete(st.key("grad"))
                write_bytes = shard.numel * 4 * (1 + len(moments))
        t3 = time.perf_counter()
        n_updated = len(st.grad_members)
        st.grad = None
        st.grad_on_nvme = False
        st.grad_members = set()
        st.grad_norms = {}
        if self._emit_detail:
            self.recorder.emit(ev.OptimizerShardDone(self.global_steps, st.name, st.place.optim, read_bytes, write_bytes, t1 - t0, t2 - t1, t3 - t2, n_updated))

    def _refresh_param_home(self, st: ShardState, master: Tensor) -> None:
        if st.param_home is master or self._param_file_is_master(st):
            return
        if st.place.param == "nvme":
            self._write(self._stores["param"], st.key("param"), master.to(self.dtype))
            if self._emit_detail:  # not part of the optimizer group's bytes: its own record
                self._emit_transfer(st, "param", "write", "nvme", self._nbytes(st)[0], 0.0)
        else:
            st.param_home.copy_(master)

    def _end_step(self, migration_s: float = 0.0) -> None:
        timer = self._step_timer
        wall = timer.stop()
        losses, self._losses = self._losses, []
        if self.recorder.enabled:
            self._emit_io()  # the step's requests come before its StepFinished
            self.recorder.emit(
                ev.StepFinished(
                    step=self.global_steps,
                    micro_batches=self.gradient_accumulation_steps,
                    wall_s=wall,
                    forward_s=timer.forward_s,
                    backward_s=timer.backward_s,
                    optimizer_s=timer.optimizer_s,
                    stall_s=timer.stall_s,
                    migration_s=migration_s,
                    loss=sum(losses) / len(losses) if losses else None,
                    read_bytes=dict(self._stats.read),
                    written_bytes=dict(self._stats.written),
                    dram_bytes=self.dram_bytes_in_use(),
                    pinned_bytes=self.pinned_bytes_in_use(),
                    gpu_bytes=torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0,
                    rss_bytes=rss_bytes(),
                    plan_version=self.plan_version,
                )
            )
        self.last_step = timer.snapshot(wall, losses)
        self.last_step["migration_s"] = migration_s
        # a step after drain() started with nothing prefetched: not one to judge a placement by
        self.last_step["after_drain"], self._drained = self._drained, False
        self.traffic_total.add(self._stats)
        self._stats = _Traffic()
        self._step_timer = _StepTimer()

    # ------------------------------------------------------------------ I/O settings (autotuning)
    # The NVMe stores' backend settings (aio block size, queue depth, thread count) and the
    # parameter prefetch window can change between optimizer steps (planner/tuning.py tries a
    # few). Only I/O scheduling changes: every value read or computed is the same.
    @property
    def io_settings(self) -> dict[str, int]:
        """The I/O settings in force: ``block_size`` (bytes), ``queue_depth`` and ``thread_count``
        of the NVMe stores' backend, and ``prefetch_bytes``, the parameter prefetch window the
        engine holds now (0: off, also when no param home is on NVMe)."""
        block_size, queue_depth, thread_count = self._aio_in_force()
        return {"block_size": block_size, "queue_depth": queue_depth, "thread_count": thread_count,
                "prefetch_bytes": self.overlap.prefetch_bytes}

    def set_io_settings(self, *, block_size: int | None = None, queue_depth: int | None = None,
                        thread_count: int | None = None, prefetch_bytes: int | None = None) -> dict[str, int]:
        """Change the NVMe I/O settings and the prefetch window, between optimizer steps.

        ``block_size`` (bytes, a multiple of 4096), ``queue_depth`` and ``thread_count`` replace
        the ``aio`` settings of every NVMe store (and of stores opened later); ``prefetch_bytes``
        replaces the window that ``stage3_prefetch_bucket_size`` (capped by ``buffer_count`` x
        ``buffer_size``) gives, 0 = prefetch off. None keeps a setting. Everything in flight is
        drained first; then the stores switch to a new backend and the overlap buffers are sized
        again, as after a migration. Returns :attr:`io_settings`. Raises ModelError inside an
        accumulation window, ConfigError for a bad value, BudgetError for a window that does not
        fit ``zinf.dram_budget`` (nothing changes then). :meth:`reset_io_settings` goes back to
        the config's settings."""
        self._check_open()
        self._check_between_steps("engine.set_io_settings")
        from zinf.storage.aligned import ALIGN

        given = {"block_size": block_size, "queue_depth": queue_depth, "thread_count": thread_count,
                 "prefetch_bytes": prefetch_bytes}
        for name, value in given.items():
            low = 0 if name == "prefetch_bytes" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"engine.set_io_settings: {name} must be an int >= {low} (or None to keep it), got {value!r}")
        if block_size is not None and block_size % ALIGN:
            raise ConfigError(f"engine.set_io_settings: block_size must be a multiple of {ALIGN} bytes "
                              f"(O_DIRECT alignment), got {block_size}; e.g. {max(ALIGN, block_size // ALIGN * ALIGN)}")
        old = self._aio_in_force()
        aio = tuple(old[i] if v is None else v for i, v in enumerate((block_size, queue_depth, thread_count)))
        want = getattr(self, "_prefetch_override", None) if prefetch_bytes is None else prefetch_bytes
        if prefetch_bytes is not None:
            self._check_prefetch_fits(prefetch_bytes)
        return self._apply_io_settings(aio, want)

    def reset_io_settings(self) -> dict[str, int]:
        """Go back to the config's I/O settings and prefetch window (see :meth:`set_io_settings`)."""
        self._check_open()
        self._check_between_steps("engine.reset_io_settings")
        return self._apply_io_settings(None, None)

    def _aio_in_force(self) -> tuple[int, int, int]:
        """(block_size, queue_depth, thread_count) of the NVMe backend: set_io_settings' or the config's."""
        override = getattr(self, "_aio_override", None)
        if override is not None:
            return override
        aio = self.config.aio
        return aio.block_size, aio.queue_depth, aio.thread_count

    def _wanted_prefetch_bytes(self) -> int:
        """The prefetch window asked for, before the DRAM budget caps it: set_io_settings' bytes,
        else ``stage3_prefetch_bucket_size`` elements (at most ``buffer_count`` x ``buffer_size``)."""
        override = getattr(self, "_prefetch_override", None)
        if override is not None:
            return override
        zero = self.config.zero_optimization
        elem = self.dtype.itemsize
        return min(zero.stage3_prefetch_bucket_size, zero.offload_param.buffer_count * zero.offload_param.buffer_size) * elem

    @property
    def prefetch_wanted_bytes(self) -> int:
        """The prefetch window asked for, before the DRAM budget caps it (for planners)."""
        return self._wanted_prefetch_bytes()

    def _check_prefetch_fits(self, want: int) -> None:
        """Raise unless a prefetch window of ``want`` bytes would be granted in full."""
        from zinf.errors import BudgetError

        nvme = [self._nbytes(st)[0] for st in self.states if st.place.param == "nvme"]
        if want == 0 or not nvme:
            return  # off, or nothing to prefetch (the window applies once params go to NVMe)
        if want < max(nvme):
            raise ConfigError(f"engine.set_io_settings: prefetch_bytes {want} is smaller than the largest parameter "
                              f"shard on NVMe ({max(nvme)} bytes), so no read would fit; use 0 (off) or at least {max(nvme)}")
        budget = self.config.zinf.dram_budget
        if budget is None:
            return
        overlap = self.sizing.overlap(self._places(), budget, want, self.dram_need)
        left = budget - self.dram_need.total_bytes - (overlap.total_bytes - overlap.prefetch_bytes)
        if overlap.prefetch_bytes < want:
            raise BudgetError(f"engine.set_io_settings: a prefetch window of {fmt_bytes(want)} does not fit zinf.dram_budget "
                              f"{fmt_bytes(budget)} ({fmt_bytes(max(0, left))} left after homes, working set and the other "
                              f"overlap buffers); ask for at most {max(0, left)} bytes or raise zinf.dram_budget")

    def _apply_io_settings(self, aio: tuple[int, int, int] | None, prefetch_want: int | None) -> dict[str, int]:
        """Drain, then put ``aio`` (None: the config's) on every store and re-size the overlap
        buffers for the window ``prefetch_want`` (None: the config's)."""
        self._drain()  # nothing may be in flight while the backends change
        if self.recorder.enabled:
            self._emit_io()  # what ran with the old settings is reported with them
        aio_cfg = self.config.aio
        block_size, queue_depth, thread_count = aio or (aio_cfg.block_size, aio_cfg.queue_depth, aio_cfg.thread_count)
        for store in {id(s): s for s in self._stores.values()}.values():
            # waits for reads still landing (cancelled prefetches), reported with the old settings
            store.reconfigure(block_size=block_size, queue_depth=queue_depth, thread_count=thread_count)
        self._aio_override, self._prefetch_override = aio, prefetch_want
        self._resize_after_migration(new_trace=False)  # prefetch window, buffer pool cap, ...
        if self._pass_open == "fresh":
            self._prefetcher.begin_pass()  # the reads _drain cancelled
        return self.io_settings

    # ------------------------------------------------------------------ migrations
    def migrate(self, moves: Iterable[Move], *, max_bytes: int | None = None) -> MigrationReport:
        """Move shards' param or optimizer homes between DRAM ("cpu") and NVMe, between steps.

        Each move writes the new home completely (on NVMe: write-new, fdatasync, atomic switch),
        verifies it, switches the shard to it, and only then frees the old home; a move that fails
        on the way leaves the shard in its old home, intact, and is reported refused. Moves run in
        the given order; once their bytes would pass ``max_bytes`` the rest are deferred. Only at
        the accumulation boundary (after the ``engine.step()`` that updates, before the next
        forward); raises ModelError elsewhere, ConfigError for unknown shards or bad moves
        (before anything moves). The outcome is also kept as ``engine.last_migration``.
        """
        self._check_open()
        t0 = time.perf_counter()
        self._check_between_steps()
        moves = self._validate_moves(moves)
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ConfigError(f"migrate's max_bytes must be None or a byte count >= 0, got {max_bytes!r}")
        report = MigrationReport()
        if moves:
            self._drain()  # nothing in flight may read or write a home that is about to move
        try:
            for move in moves:
                self._migrate_one(move, report, max_bytes)
        finally:  # also when interrupted: what was done is switched and must be served right
            if report.done:
                self._resize_after_migration(new_trace=any(m.state == "param" for m in report.done))
            if self._pass_open == "fresh":
                self._prefetcher.begin_pass()  # the reads _drain cancelled, now from the new homes
            report.seconds = time.perf_counter() - t0
            self.last_migration = report
        return report

    def _migrate_one(self, move: Move, report: MigrationReport, max_bytes: int | None) -> None:
        """Make one move, or record in ``report`` why not (refused, or deferred: the byte budget
        ran out, at this move or an earlier one)."""
        st = self._state_by_name[move.shard]
        src = getattr(st.place, move.state)
        if src == move.dst:
            return  # already there: a no-op, not counted
        why = self._refusal(st, move, src)
        if why is not None:
            report.refused.append((move, why))
            return
        new = ShardPlacement(**{**st.place.as_dict(), move.state: move.dst})
        nbytes = self._added_bytes(st, new)
        if report.deferred or (max_bytes is not None and report.bytes_moved + nbytes > max_bytes):
            report.deferred.append(move)
            return
        why = self._over_dram_budget(st, new)
        if why is not None:
            report.refused.append((move, why))
            return
        t0 = time.perf_counter()
        try:
            with span(f"zinf.migrate.{move.state}.{src}_to_{move.dst}"):
                self._relocate(st, new)
        except Exception as e:  # the shard is still in its old home (see _relocate)
            why = f"{type(e).__name__}: {e}; {st.name} stays in its {src} home"
            log.warning("migration of %s %s to %s failed: %s", st.name, move.state, move.dst, why)
            report.refused.append((move, why))
            return
        seconds = time.perf_counter() - t0
        report.done.append(move)
        report.bytes_moved += nbytes
        if self.recorder.enabled:
            self.recorder.emit(ev.ShardMigrated(self.global_steps, st.name, move.state, src, move.dst, nbytes, seconds))

    def _check_between_steps(self, what: str = "engine.migrate") -> None:
        """Raise unless no micro-batch of an accumulation window is under way."""
        if self._in_backward or self._window_open or self.micro_steps % self.gradient_accumulation_steps:
            raise ModelError(
                f"{what} may only be called between optimizer steps (after the engine.step() that ends "
                f"an accumulation window of {self.gradient_accumulation_steps}, before the next forward); "
                f"micro-batch {self.micro_steps % self.gradient_accumulation_steps + 1} is under way")

    def _validate_moves(self, moves: Iterable[Move] | None) -> list[Move]:
        """``moves`` as a list of Move (3-tuples accepted), every shard name known."""
        if moves is None:
            return []
        if isinstance(moves, (Move, str)):
            moves = [moves]
        out: list[Move] = []
        for m in moves:
            if not isinstance(m, Move):
                if not (isinstance(m, (tuple, list)) and len(m) == 3):
                    raise ConfigError(f"migrate takes zinf.placement.Move(shard, state, dst) items, got {m!r}")
                m = Move(*m)
            if m.shard not in self._state_by_name:
                some = ", ".join(repr(n) for n in list(self._state_by_name)[:3])
                raise ConfigError(f"migrate: unknown shard {m.shard!r}; shard names are the keys of "
                                  f"engine.placement ({len(self.states)} shards, e.g. {some})")
            out.append(m)
        return out

    def _refusal(self, st: ShardState, move: Move, src: str) -> str | None:
        """Why ``move`` may never be made in this engine (None: it may)."""
        if "gpu" in (src, move.dst):
            return "gpu-tier migrations are not supported yet"
        if move.state == "optim" and not st.shard.trainable:
            return f"{st.name} is frozen (requires_grad=False): it has no optimizer home to move"
        pins, section = (self._param_pins, "offload_param") if move.state == "param" else (self._optim_pins, "offload_optimizer")
        pin = pins.match(st.shard.members[0].name.rpartition(".")[0])
        if pin is not None:
            return f"pinned by module_parameters {pin.pattern!r} (zero_optimization.{section}) to {pin.tier}"
        return None

    def dram_need_of(self, placement: Mapping[str, Mapping[str, str]]) -> DramNeed:
        """The DRAM need (homes, working set, staging; no overlap buffers) the engine would have
        with ``placement`` ({shard: {"param": tier, "optim": tier}}; shards left out keep their
        tiers), computed as ``initialize`` checks it. Nothing moves and no state changes. For
        planners: the working set shrinks when params become resident, which a plan may spend on
        hot homes. (A planner in another process asks :attr:`sizing` the same.)"""
        return self.sizing.need(self.sizing.places_of(placement, self._places()))

    def overlap_of(self, placement: Mapping[str, Mapping[str, str]]) -> Overlap:
        """The overlap buffers (prefetch window, writes in flight, read-ahead, updates during
        backward) the engine would grant under ``zinf.dram_budget`` with ``placement``, as it
        re-sizes them after a migration. Nothing moves and no state changes. For planners: what a
        plan leaves of the budget decides which kinds of overlap the engine keeps."""
        places = self.sizing.places_of(placement, self._places())
        return self.sizing.overlap(places, self.config.zinf.dram_budget, self._wanted_prefetch_bytes())

    def _over_dram_budget(self, st: ShardState, new: ShardPlacement) -> str | None:
        """Why placing ``st`` at ``new`` would break ``zinf.dram_budget`` (None: it fits), by the
        DRAM need initialize checks (homes + working set + staging; the overlap buffers are sized
        from what is left afterwards, as at start)."""
        budget = self.config.zinf.dram_budget
        if budget is None:
            return None
        places = self._places()
        places[st.shard.index] = new
        need = self._dram_need(places)
        if need.total_bytes <= budget:
            return None
        return (f"over the DRAM budget: the placement would need {fmt_bytes(need.total_bytes)} of DRAM, "
                f"zinf.dram_budget is {fmt_bytes(budget)}; move other homes to nvme first or raise the budget")

    # A shard's homes, as (tier, what): "what" is "param" (the working copy, compute dtype),
    # "master" or an optimizer state name (fp32). Aliased homes (the DRAM master that is also the
    # fp32 working copy; the NVMe master file that is also the param file) are listed once.
    def _homes(self, st: ShardState, place: ShardPlacement) -> list[tuple[str, str]]:
        homes = []
        if not self._aliases_master(st, place) and not self._param_file_is_master(st, place):
            homes.append((place.param, "param"))
        if st.shard.trainable:
            names = ("master", *self.optimizer.state_names) if st.has_moments else ("master",)
            homes += [(place.optim, name) for name in names]
        return homes

    def _home_bytes(self, st: ShardState, what: str) -> int:
        return self._nbytes(st)[0] if what == "param" else st.shard.numel * 4

    def _added_bytes(self, st: ShardState, new: ShardPlacement) -> int:
        """Bytes a move to ``new`` copies: those of the homes ``new`` has and the current lacks."""
        old = self._homes(st, st.place)
        return sum(self._home_bytes(st, what) for tier, what in self._homes(st, new) if (tier, what) not in old)

    def _relocate(self, st: ShardState, new: ShardPlacement) -> None:
        """Give ``st`` the placement ``new``: write the homes it adds (durable and verified),
        switch to them, then free the homes it drops. If anything before the switch raises, the
        new copies are removed and the shard is untouched in its old homes."""
        old = st.place
        old_homes, new_homes = self._homes(st, old), self._homes(st, new)
        added = [h for h in new_homes if h not in old_homes]
        dropped = [h for h in old_homes if h not in new_homes]
        written: list[tuple[object, str]] = []  # (store, key) of new NVMe files, for the undo
        copies: dict[str, Tensor] = {}  # what -> its new DRAM (or device) home
        try:
            for role in ("param", "optim"):
                if getattr(new, role) == "nvme":
                    self._open_store(role)  # also when no file is written (the master file serves)
            nvme_bytes = {}
            for tier, what in added:
                if tier == "nvme":
                    role = "param" if what == "param" else "optim"
                    nvme_bytes[role] = nvme_bytes.get(role, 0) + self._home_bytes(st, what)
            for role, nbytes in nvme_bytes.items():
                self._stores[role].check_space(nbytes)
            for tier, what in added:
                src, fresh = self._home_content(st, what)
                if tier == "nvme":
                    store = self._stores["param" if what == "param" else "optim"]
                    written.append((store, st.key(what)))
                    self._write_verified(store, st.key(what), src)
                else:
                    copies[what] = self._dram_copy(src, tier, fresh)
                    if tier == "cpu" and (what == "param" or (what == "master" and self._aliases_master(st, new))):
                        copies[what] = self._host_param_home(copies[what])  # uploads read it
        except BaseException:
            for store, key in written:
                try:
                    store.delete(key)
                except Exception as e:  # a leftover file under a key nobody reads: harmless
                    log.warning("could not remove %s after a failed migration: %s", key, e)
            raise
        self._switch(st, new, copies)
        self._free_homes(st, dropped)

    def _home_content(self, st: ShardState, what: str) -> tuple[Tensor, bool]:
        """The current value of ``what`` from the shard's current homes, and whether the tensor
        is a fresh read (True) or a home's own tensor (False, must not be handed on)."""
        place = st.place
        if what == "param":
            if self._aliases_master(st):
                return st.master, False
            if self._param_file_is_master(st):
                return self._stores["optim"].read(st.key("master")), True
            if place.param == "nvme":
                return self._stores["param"].read(st.key("param")), True
            return st.param_home, False
        if place.optim == "nvme":
            return self._stores["optim"].read(st.key(what)), True  # checksum verified
        return (st.master if what == "master" else st.moments[what]), False

    def _write_verified(self, store, key: str, t: Tensor) -> None:
        """Write ``t`` durably under ``key``, read it back (checksum) and compare it bit for bit."""
        store.write(key, t)  # write-new -> fdatasync -> atomic switch
        nbytes = t.numel() * t.element_size()
        buffer = self._buffers.get(nbytes)
        try:
            back = store.read(key, out=buffer[:nbytes].view(t.dtype))
            if not _same_bytes(back, t.reshape(-1)):
                raise CorruptShardError(f"{store.path(key)} read back differs from what was written")
        finally:
            self._buffers.put(buffer)

    def _dram_copy(self, src: Tensor, tier: str, fresh: bool) -> Tensor:
        """A new home on ``tier`` ("cpu": DRAM, "gpu": the compute device) holding ``src``."""
        device = self.device if tier == "gpu" else torch.device("cpu")
        if fresh and src.device == device:
            return src  # a fresh, checksum-verified read: it can be the home itself
        copy = src.to(device, copy=True)
        if not _same_bytes(copy.cpu(), src.cpu()):
            raise RuntimeError("the new DRAM copy differs from its source")
        return copy

    def _switch(self, st: ShardState, new: ShardPlacement, copies: dict[str, Tensor]) -> None:
        """Point the catalog (and the model's parameters) at the new homes. Nothing here fails
        halfway: only references change."""
        # (CUDA) a DRAM master that becomes the param home too is what uploads read: page-locked
        # (a copy, made before any reference changes)
        stays = "master" not in copies and st.master is not None and self._aliases_master(st, new)
        pinned_master = self._host_param_home(st.master) if stays else None
        self._discard_group_reads(st)  # a read ahead of the old home nobody will use
        old = st.place
        st.place = new
        if new.optim == "nvme":
            st.grad_buffer = None  # an NVMe optimizer home takes its accumulator from the pool
        dram = ("gpu", "cpu")
        if st.shard.trainable and old.optim != new.optim:
            if new.optim in dram:
                st.master = copies["master"]
                st.moments = {n: copies[n] for n in self.optimizer.state_names if n in copies}
            else:
                st.master, st.moments = None, {}
        if pinned_master is not None:
            st.master = pinned_master
        if self._aliases_master(st):
            st.param_home = st.master
        elif new.param == "nvme":
            st.param_home = None
        elif "param" in copies:
            st.param_home = copies["param"]
        self._point_params(st)

    def _free_homes(self, st: ShardState, dropped: list[tuple[str, str]]) -> None:
        """Delete the NVMe files of homes the shard left (DRAM homes went with their last
        reference in _switch). The data is safe in the new home: a failure here only warns."""
        files: dict[str, str] = {}  # what -> role of its store
        for tier, what in dropped:
            if tier == "nvme":
                files[what] = "param" if what == "param" else "optim"
        if "master" in files:  # the whole group left: no stale moment or gradient file may stay
            files.update({name: "optim" for name in (*self.optimizer.state_names, "grad")})
        for what, role in files.items():
            try:
                self._stores[role].delete(st.key(what))
            except Exception as e:
                log.warning("migration of %s: could not delete its old file %s: %s", st.name, st.key(what), e)

    def _resize_after_migration(self, new_trace: bool) -> None:
        """Recompute the DRAM need and the overlap (prefetch window, writes in flight, updates
        during backward) for the new placement, as initialize would; with ``new_trace`` (param
        homes moved) the prefetcher records the trace again in the next pass."""
        self.dram_need = self._dram_need()
        self.overlap = self._size_overlap(self.config.zinf.dram_budget)
        self.dram_need.overlap_bytes = self.overlap.total_bytes
        self._writes = _WriteWindow(self.overlap.write_bytes)  # drained: nothing in flight
        max_free = self.overlap.total_bytes + self._largest_nvme_group_bytes()
        if max_free < self._buffers.max_free_bytes:
            self._buffers.clear()
        self._buffers.max_free_bytes = max_free
        if (self.overlap.eager or self._eager_dram) and self._eager is None:
            self._eager = self._optimizer_worker()
        elif not (self.overlap.eager or self._eager_dram) and self._eager is not None:
            self._eager.shutdown(wait=True)
            self._eager = None
        if new_trace:
            self._prefetcher = self._new_prefetcher(self._prefetcher.stats)
        else:
            self._prefetcher.window_bytes = self.overlap.prefetch_bytes

    def _consult_controller(self) -> float:
        """Ask the controller for moves and make them within the per-step byte budget; returns
        the seconds spent migrating. A failing controller is logged (once per message), never
        fatal: training goes on without its moves."""
        try:
            moves = self._validate_moves(self.controller.after_step(self))
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            if message not in self._controller_warnings:
                self._controller_warnings.add(message)
                log.warning("placement controller %s failed after step %d (%s); training goes on without its moves",
                            type(self.controller).__name__, self.global_steps, message)
            self.last_migration = MigrationReport()
            return 0.0
        if not moves:
            self.last_migration = MigrationReport()
            return 0.0
        report = self.migrate(moves, max_bytes=self.config.zinf.placement.migration_bytes_per_step)
        return report.seconds

    # ------------------------------------------------------------------ introspection
    @property
    def prefetch_stats(self) -> PrefetchStats:
        """A copy of the prefetcher's counters since initialize (reads issued ahead, hits,
        misses, dropped, kept)."""
        return replace(self._prefetcher.stats)

    @property
    def announced_reads(self) -> bool:
        """Whether the model has announced modules it runs next (``zinf.will_use``) and reads
        were started on its word: the planner's simulator then models them (not as misses)."""
        return self._prefetcher.stats.hinted > 0

    @property
    def placement(self) -> dict[str, dict[str, str]]:
        """{shard name: {"param": tier, "optim": tier}}."""
        return {st.name: st.place.as_dict() for st in self.states}

    def dram_bytes_in_use(self) -> int:
        """Bytes of DRAM tensors the engine holds now (homes, accumulators, materialised params)."""
        total = 0
        seen: set[int] = set()
        for st in self.states:
            for t in [st.param_home, st.master, st.grad, st.grad_buffer, *st.moments.values()]:
                if t is not None and t.device.type == "cpu" and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
            if st.param_state is ParamState.MATERIALISED and self.device.type == "cpu":
                total += st.shard.numel * self.dtype.itemsize
        return total + self._buffers.in_use_bytes

    def pinned_bytes_in_use(self) -> int:
        """Bytes of page-locked host memory the engine holds now: the pooled I/O buffers (handed
        out and kept free) and the NVMe stores' staging buffers, both pinned only with CUDA."""
        if self.device.type != "cuda":
            return 0
        pool = self._buffers.in_use_bytes + self._buffers.free_bytes if self._buffers.pin else 0
        stores = {id(s): s for s in self._stores.values()}.values()
        return pool + sum(s.staging_bytes_total for s in stores)

    def _master_flat(self, st: ShardState) -> Tensor:
        if not st.shard.trainable:
            src = self._stores["param"].read(st.key("param")) if st.place.param == "nvme" else st.param_home
            return src.to("cpu", torch.float32)
        if st.place.optim == "nvme":
            return self._stores["optim"].read(st.key("master"))
        return st.master.to("cpu")

    def state_dict(self) -> dict[str, Tensor]:
        """{fully qualified name: fp32 master tensor} for every name of model.named_parameters(),
        tied names included (they share one tensor). A frozen parameter has no master: its value
        is its working copy's (in bf16/fp16 runs, rounded to that precision at ``initialize``)."""
        self._check_open()
        self._drain()
        out: dict[str, Tensor] = {}
        for st in self.states:
            flat = self._master_flat(st)
            for m in st.shard.members:
                t = flat[m.offset : m.offset + m.numel].view(m.shape).clone()
                for name in m.names:
                    out[name] = t
        return out

    def save_checkpoint(self, directory: str | os.PathLike) -> Path:
        """Save the whole training state under ``directory`` (crash-safe: see zinf.checkpoint)."""
        from zinf.checkpoint import save_checkpoint

        self._check_open()
        self._drain()
        return save_checkpoint(self, Path(directory))

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Restore the state saved by :meth:`save_checkpoint` (into this engine's placement)."""
        from zinf.checkpoint import load_checkpoint

        self._check_open()
        self._drain()
        load_checkpoint(self, Path(directory))
        self._window_open = False  # gradients of micro-batches before the load are dropped
        self._prefetcher.begin_pass()  # reads queue behind the restored files
        self._pass_open = "fresh"

    def _check_open(self) -> None:
        if self._closed:
            raise ModelError("this zinf engine is closed; build a new one with zinf.initialize")

    def _drain(self) -> None:
        """Wait for all background work: updates during backward, prefetches, writes in flight.
        Raises the first error any of them met."""
        self._prefetcher.cancel()
        self._free_kept()
        if self._cuda is not None:
            self._land_grads(block=True)
            self._cuda.synchronize()
        self._wait_updates_during_backward()
        self._writes.wait_all()
        for store in {id(s): s for s in self._stores.values()}.values():
            store.flush()

    def _close_stores(self) -> None:
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            prefetcher.cancel()
        if getattr(self, "_eager", None) is not None:
            self._eager.shutdown(wait=True)
        for store in {id(s): s for s in self._stores.values()}.values():
            store.close()  # finishes the requests in flight first
        self._stores = {}

    def drain(self) -> None:
        """Between optimizer steps: wait for the engine's background work (updates, prefetches,
        write-behind) so that none of it is left in flight; the next step starts with nothing
        prefetched (its ``last_step["after_drain"]`` is True, and the adaptive planner does not
        measure it). Raises the first error a background request met. For handing the disk and
        cores to other work - e.g. timing several engines side by side, a block of steps each."""
        self._check_open()
        self._check_between_steps("engine.drain")
        self._drain()
        self._drained = True  # the next step's last_step says "after_drain" (the planner leaves it out)

    def close(self) -> None:
        """Remove hooks, flush the recorder and delete this run's swap files. Idempotent."""
        if self._closed:
            return
        try:
            self._drain()  # a write that failed in the background must not pass unnoticed
        except BaseException:
            self._close_quietly("crashed")
            raise
        self._close_quietly("finished")

    def _close_quietly(self, status: str) -> None:
        self._closed = True
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        hints.unregister(self.module)
        if self.recorder.enabled:
            self._emit_io()
            self.recorder.emit(ev.RunFinished(status, self.global_steps, time.time()))
        self.recorder.close()
        self._close_stores()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._closed:
            self._close_quietly("crashed")  # the error in flight is the one to report
        self.close()

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            if not self._closed:
                self._close_stores()
        except Exception:
            pass

    # ------------------------------------------------------------------ events
    @property
    def _emit_detail(self) -> bool:
        """Whether the detail events of the step under way (:class:`ev.ShardFetched`,
        :class:`ev.ShardTransfer`, :class:`ev.OptimizerShardDone`, the step's :class:`ev.IoBatch`)
        are built and sent: the recorder is on and, if it samples shard detail (the profiler's
        ``Recorder.shard_detail_now``, a plain attribute; recorders without it get every step), this
        step is one it records. Checked before an event is built, so an unrecorded step builds none."""
        r = self.recorder
        return r.enabled and getattr(r, "shard_detail_now", True)

    def _emit_fetch(self, st: ShardState, phase: str, tier: str, nbytes: int, fetch_s: float, stall_s: float,
                    overhead_s: float = 0.0) -> None:
        self.recorder.emit(ev.ShardFetched(self.global_steps, self.micro_steps, st.name, phase, tier, nbytes, fetch_s, stall_s,
                                           overhead_s))

    def _emit_transfer(self, st: ShardState, what: str, op: str, tier: str, nbytes: int, stall_s: float) -> None:
        self.recorder.emit(ev.ShardTransfer(self.global_steps, st.name, what, op, tier, nbytes, stall_s))

    def _emit_run_started(self) -> None:
        infos = []
        for st in self.states:
            pb, ob, gb = self._nbytes(st)
            infos.append(ev.ShardInfo(st.name, st.shard.module, st.shard.kind, st.shard.numel, pb, ob, gb,
                                      tuple(n for m in st.shard.members for n in m.names), st.place.param, st.place.optim))
        n_params = sum(s.numel for s in self.shards)
        model = {
            "class": type(self.module).__name__,
            "params": n_params,
            "trainable_params": sum(s.numel for s in self.shards if s.trainable),
            "shards": len(self.shards),
            "state_bytes": sum(sum(self._nbytes(st)) for st in self.states),
        }
        swap = next(iter(self._stores.values())).run_dir if self._stores else None
        self.recorder.emit(ev.RunStarted(self.run_name, self.config.to_dict(), model,
                                         describe([s.root for s in self._stores.values()]),
                                         tuple(infos), str(swap) if swap else None, self.o_direct, time.time()))


class _Traffic:
    """Bytes moved per tier (read: into compute; written: back to a home)."""

    def __init__(self) -> None:
        self.read = {"gpu": 0, "cpu": 0, "nvme": 0}
        self.written = {"gpu": 0, "cpu": 0, "nvme": 0}

    def add(self, other: "_Traffic") -> None:
        for k in self.read:
            self.read[k] += other.read[k]
            self.written[k] += other.written[k]


class _StepTimer:
    """Seconds spent in each phase of the current optimizer step."""

    def __init__(self) -> None:
        self.t0 = None
        self.forward_s = self.backward_s = self.optimizer_s = self.stall_s = 0.0

    @property
    def running(self) -> bool:
        return self.t0 is not None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 is not None else 0.0

    def snapshot(self, wall_s: float, losses: list[float]) -> dict:
        return {
            "wall_s": wall_s,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "stall_s": self.stall_s,
            "loss": sum(losses) / len(losses) if losses else None,
        }


class _WriteWindow:
    """Asynchronous writes in flight, at most ``cap_bytes`` of them: :meth:`reserve` waits for
    room. The first error of any of them is raised by the next reserve or :meth:`wait_all`."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.in_flight_bytes = 0
        self._futures: set[Future] = set()
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def reserve(self, nbytes: int) -> None:
        with self._cond:
            # one write larger than the window still goes, alone
            self._cond.wait_for(lambda: self.in_flight_bytes == 0 or self.in_flight_bytes + nbytes <= self.cap_bytes
                                or self._error is not None)
            self._raise()
            self.in_flight_bytes += nbytes

    def track(self, future: Future, nbytes: int, on_done=None) -> None:
        with self._cond:
            self._futures.add(future)

        def done(f: Future) -> None:
            if on_done is not None:
                on_done()
            with self._cond:
                self._futures.discard(f)
                self.in_flight_bytes -= nbytes
                if f.exception() is not None and self._error is None:
                    self._error = f.exception()
                self._cond.notify_all()

        future.add_done_callback(done)

    def wait_all(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._futures)
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
