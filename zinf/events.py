"""Structured events the engine emits, and the recorder interface that consumes them.

The engine never imports the profiler: it calls ``recorder.emit(event)`` on whatever object it was
given. The default :class:`NullRecorder` has ``enabled = False`` and the engine checks that flag
before it builds an event, so a run without profiling pays one attribute read per hook.

Every event is a small frozen dataclass; field names carry units (``_s`` seconds, ``_bytes``
bytes). Between them they carry everything the profile tables need (see docs/architecture.md):

============================  ================================================================
table                         events
============================  ================================================================
runs                          :class:`RunStarted`, :class:`RunFinished`
shards                        :class:`RunStarted` (``shards``)
steps                         :class:`StepFinished`
shard_steps                   :class:`ShardFetched`, :class:`OptimizerShardDone`, :class:`ShardTransfer`
io_samples                    :class:`IoBatch` (of :class:`IoDone`)
migrations                    :class:`ShardMigrated`
============================  ================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Phases in which a shard is accessed. "recompute" is a forward run again inside backward
# (activation checkpointing); "optimizer" is the update of its optimizer group.
PHASES = ("forward", "backward", "recompute", "optimizer")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """Static description of one shard, sent once per run in :class:`RunStarted`."""

    name: str
    module: str  # the module that owns the first member parameter ("" for the root)
    kind: str  # "param" (one large parameter), "chunk" (packed small ones), "frozen", "expert", "embedding"
    numel: int
    param_bytes: int  # bytes of the working copy in the compute dtype
    optim_bytes: int  # bytes of master + optimizer moments (fp32); 0 for frozen shards
    grad_bytes: int  # bytes of the fp32 gradient accumulator; 0 for frozen shards
    members: tuple[str, ...]  # fully qualified names of the parameters it holds
    param_tier: str  # tier of the param home at start: "gpu", "cpu" or "nvme"
    optim_tier: str  # tier of the optimizer home at start ("none" for frozen shards)


@dataclass(frozen=True, slots=True)
class RunStarted:
    run_name: str
    config: dict[str, Any]  # the validated config, as JSON-able dict
    model: dict[str, Any]  # class name, parameter counts, state bytes
    hardware: dict[str, Any]  # cpu, dram, gpu, filesystem of nvme_path
    shards: tuple[ShardInfo, ...]
    swap_dir: str | None
    o_direct: bool  # False when the filesystem refused O_DIRECT and buffered I/O is used
    started_at: float  # time.time()


@dataclass(frozen=True, slots=True)
class ShardFetched:
    """One access of a shard's param on the compute device: one use by a module that owns one of
    its parameters (``bytes`` 0 when it was already there: resident, kept, or held for the pass)."""

    step: int  # optimizer step this access belongs to (engine.global_steps at the time)
    micro_step: int
    shard: str
    phase: str  # one of PHASES, not "optimizer"
    tier: str  # where it came from
    bytes: int  # bytes moved (0 when the param home is already on the compute device)
    fetch_s: float  # time the copy/read took
    stall_s: float  # time compute waited for it (== fetch_s for a synchronous fetch)
    overhead_s: float = 0.0  # of stall_s, the time not spent waiting for a read (resize, copy out, upload launch)


@dataclass(frozen=True, slots=True)
class ShardTransfer:
    """Bytes of a shard moved outside a fetch and an optimizer group's read/write: its gradient
    accumulator written to NVMe and read back between micro-batches, its param file rewritten
    after an update. With :class:`ShardFetched` and :class:`OptimizerShardDone` this attributes
    to a shard every byte of a step's ``read_bytes`` / ``written_bytes``."""

    step: int
    shard: str
    what: str  # "grad" or "param"
    op: str  # "read" or "write"
    tier: str
    bytes: int
    stall_s: float  # time compute waited for it, as the step's stall_s counts it (0 for writes behind)


@dataclass(frozen=True, slots=True)
class IoDone:
    """One read or write of a whole shard state file (split into blocks by the I/O backend)."""

    op: str  # "read" or "write"
    tier: str  # "nvme" (DRAM copies are not I/O samples)
    what: str  # the state: "param", "grad", "master", "exp_avg", "exp_avg_sq", "momentum"
    shard: str
    bytes: int
    seconds: float
    o_direct: bool
    block_size: int
    queue_depth: int
    thread_count: int
    concurrency: float = 1.0  # mean requests in flight on the disk while it ran, itself included


@dataclass(frozen=True, slots=True)
class IoBatch:
    """The shard-file requests that finished since the previous batch, sent once per step (and
    before the I/O settings change, and at the end). One event per request, built on the I/O
    thread that finished it, cost ~6 us of interpreter time each, under the GIL the training
    thread needs: ~2% of a step of the planner benchmark's GPT (396 requests a step).

    ``requests``: rows ``(op, what, shard, bytes, seconds, concurrency)`` as in :class:`IoDone`;
    the other fields are the same for every row (settings change only between batches)."""

    requests: tuple[tuple[str, str, str, int, float, float], ...]
    tier: str
    o_direct: bool
    block_size: int
    queue_depth: int
    thread_count: int

    def items(self) -> list[IoDone]:
        """The batch as one :class:`IoDone` per request."""
        return [IoDone(op, self.tier, what, shard, nbytes, seconds, self.o_direct, self.block_size,
                       self.queue_depth, self.thread_count, concurrency)
                for op, what, shard, nbytes, seconds, concurrency in self.requests]


@dataclass(frozen=True, slots=True)
class OptimizerShardDone:
    """The optimizer group of one shard was brought in, updated and written back."""

    step: int
    shard: str
    tier: str  # optimizer home tier
    read_bytes: int
    write_bytes: int
    read_s: float
    update_s: float
    write_s: float
    params_updated: int  # member parameters that had a gradient


@dataclass(frozen=True, slots=True)
class ShardMigrated:
    """A shard's param or optimizer home moved from one tier to another between steps."""

    step: int
    shard: str
    state: str  # "param" or "optim"
    src_tier: str
    dst_tier: str
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class StepFinished:
    """One optimizer step (all its micro-batches) is done."""

    step: int  # engine.global_steps after the step
    micro_batches: int
    wall_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    stall_s: float
    migration_s: float
    loss: float | None  # mean of the unscaled losses passed to engine.backward in this step
    read_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes read this step
    written_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes written
    dram_bytes: int = 0  # bytes of DRAM homes + working buffers held by the engine
    pinned_bytes: int = 0
    gpu_bytes: int = 0
    rss_bytes: int = 0  # resident set size of the process
    plan_version: int = 0


@dataclass(frozen=True, slots=True)
class RunFinished:
    status: str  # "finished" or "crashed"
    steps: int
    finished_at: float


Event = (RunStarted | ShardFetched | ShardTransfer | IoDone | IoBatch | OptimizerShardDone | ShardMigrated
         | StepFinished | RunFinished)


@runtime_checkable
class Recorder(Protocol):
    """What the engine talks to. ``enabled`` False means: do not even build events."""

    enabled: bool

    def emit(self, event: Event) -> None: ...

    def close(self) -> None: ...


class NullRecorder:
    """The default recorder: drops everything, and tells the engine not to build events."""

    enabled = False

    def emit(self, event: Event) -> None:  # pragma: no cover - never called when disabled
        pass

    def close(self) -> None:
        pass


class ListRecorder:
    """Keeps every event in a list (an :class:`IoBatch` as its :class:`IoDone` items); used by
    tests and by ``zinf demo``'s summary."""

    enabled = True

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        if type(event) is IoBatch:
            self.events.extend(event.items())
        else:
            self.events.append(event)

    def close(self) -> None:
        pass

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


class FanoutRecorder:
    """Sends each event to several recorders (e.g. the profiler and the demo's summary)."""

    def __init__(self, *recorders: Recorder) -> None:
        self.recorders = [r for r in recorders if r.enabled]
        self.enabled = bool(self.recorders)

    def emit(self, event: Event) -> None:
        for r in self.recorders:
            r.emit(event)

    def close(self) -> None:
        for r in self.recorders:
            r.close()
