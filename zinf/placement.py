"""Static placement policies and the DRAM budget they must fit in.

A placement gives every shard two homes: where its working copy (``param``) lives between uses,
and where its optimizer group (fp32 master, moments and gradient accumulator, ``optim``) lives
between steps. Tiers are ``gpu`` (the compute device; on a machine without a GPU that is the CPU
itself), ``cpu`` (a DRAM home) and ``nvme`` (a file under ``nvme_path``).

The static policies, from the DeepSpeed keys of the config:

* ``offload_param.device`` / ``offload_optimizer.device``: ``none`` -> ``gpu``, ``cpu``, ``nvme``;
* ``offload_param.max_in_cpu`` (only when given explicitly): with ``device: nvme``, the first N
  elements in model order keep a DRAM param home, as DeepSpeed documents it;
* ``module_parameters`` pins (in either offload section) override both for the modules they match.

The DRAM a placement needs is computed analytically (:class:`DramNeed`, filled in by the engine)
so that a budget that cannot be met is refused at ``initialize`` instead of ending in an
out-of-memory kill later.

Between optimizer steps the engine can move homes between DRAM and NVMe (:meth:`Engine.migrate`,
one :class:`Move` per home, a :class:`MigrationReport` back). A :class:`PlacementController` (the
planner's, or any object with ``after_step``) proposes such moves after every optimizer step; the
engine core knows only this interface, never the planner itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from zinf.errors import BudgetError, ConfigError
from zinf.shards import Shard

if TYPE_CHECKING:  # the engine imports this module; only type checkers need the reverse
    from zinf.engine import Engine

log = logging.getLogger("zinf")

TIERS = ("gpu", "cpu", "nvme")
MOVE_STATES = ("param", "optim")  # which home of a shard a Move relocates
_DEVICE_TO_TIER = {"none": "gpu", "gpu": "gpu", "cpu": "cpu", "nvme": "nvme"}


@dataclass
class ShardPlacement:
    param: str  # tier of the param home
    optim: str  # tier of the optimizer home; "none" for frozen shards

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def static_placement(shards: list[Shard], cfg, *, optim_pin_for=lambda name: None) -> list[ShardPlacement]:
    """The placement DeepSpeed's keys (plus zinf's pins) describe, one entry per shard."""
    zero = cfg.zero_optimization
    param_default = _DEVICE_TO_TIER[zero.offload_param.device]
    optim_default = _DEVICE_TO_TIER[zero.offload_optimizer.device]
    # DeepSpeed's default max_in_cpu (1e9) would keep every model under a billion parameters in
    # DRAM; zinf applies the key only when the user wrote it.
    max_in_cpu = zero.offload_param.max_in_cpu if "max_in_cpu" in zero.offload_param.model_fields_set else 0
    placed: list[ShardPlacement] = []
    elements_in_cpu = 0
    for s in shards:
        param = param_default
        if param == "nvme" and elements_in_cpu + s.numel <= max_in_cpu:
            param = "cpu"
            elements_in_cpu += s.numel
        if s.pin is not None:
            param = _DEVICE_TO_TIER[s.pin]
        if s.trainable:
            optim = optim_pin_for(s.members[0].name)
            optim = _DEVICE_TO_TIER[optim] if optim else optim_default
        else:
            optim = "none"
        placed.append(ShardPlacement(param, optim))
    return placed


@dataclass(frozen=True)
class Move:
    """Relocate one home of one shard: ``state`` "param" (the working copy between uses) or
    "optim" (fp32 master and optimizer moments) of shard ``shard`` (a name of
    ``engine.placement``) to tier ``dst`` ("cpu" = DRAM, "nvme" = a swap file).

    Values are checked here so that a bad move fails where it is written, before any move runs;
    ``dst`` "gpu" is accepted but the engine refuses it (gpu-tier migrations are not supported yet).
    """

    shard: str
    state: str
    dst: str

    def __post_init__(self) -> None:
        if not isinstance(self.shard, str) or not self.shard:
            raise ConfigError(f"Move.shard must be a shard name (a key of engine.placement), got {self.shard!r}")
        if self.state not in MOVE_STATES:
            raise ConfigError(f"Move.state must be one of {', '.join(map(repr, MOVE_STATES))}, got {self.state!r}")
        if self.dst not in TIERS:
            raise ConfigError(f"Move.dst must be one of 'cpu', 'nvme' (or 'gpu', refused for now), got {self.dst!r}")


@dataclass
class MigrationReport:
    """What :meth:`Engine.migrate` did with the moves it was given (in their order).

    A move to the tier its home already has is a no-op and appears in none of the lists.
    """

    done: list[Move] = field(default_factory=list)
    """Moves applied: the new home is written, verified and switched to; the old one is freed."""
    deferred: list[Move] = field(default_factory=list)
    """Moves not tried because the byte budget (``max_bytes``) ran out; ask again next step."""
    refused: list[tuple[Move, str]] = field(default_factory=list)
    """Moves not applied, with why (pinned, over the DRAM budget, a write failed, ...). A move
    that failed midway left its shard in the old home, intact."""
    bytes_moved: int = 0
    """Bytes copied into new homes by the done moves."""
    seconds: float = 0.0
    """Wall-clock seconds of the whole migrate call."""


@runtime_checkable
class PlacementController(Protocol):
    """Decides migrations between steps. The engine calls :meth:`after_step` once per optimizer
    step (after the update, before the step is recorded as finished) and migrates what it returns,
    within ``zinf.placement.migration_bytes_per_step``; ``engine.last_migration`` is the outcome."""

    def after_step(self, engine: "Engine") -> Iterable[Move] | None:
        """Moves to make now (None or empty: nothing)."""
        ...


class ChainedController:
    """Several controllers as one: :meth:`after_step` asks each in turn (in the given order) and
    returns all their moves, concatenated. One that raises is logged (once per message, logger
    ``zinf``) and skipped for that step; the others still run. ``zinf.initialize`` uses it to run
    the I/O autotuner before the adaptive planner."""

    def __init__(self, *controllers: PlacementController) -> None:
        for c in controllers:
            if not callable(getattr(c, "after_step", None)):
                raise ConfigError(f"ChainedController takes objects with an after_step(engine) method, got {c!r}")
        self.controllers = list(controllers)
        self._warned: set[str] = set()

    def after_step(self, engine: "Engine") -> list[Move]:
        moves: list[Move] = []
        for c in self.controllers:
            try:
                got = c.after_step(engine)
            except Exception as e:  # one controller's failure must not cost the others' moves
                message = f"{type(c).__name__}: {type(e).__name__}: {e}"
                if message not in self._warned:
                    self._warned.add(message)
                    log.warning("placement controller %s failed; training goes on without its moves", message)
                continue
            if isinstance(got, Move):
                moves.append(got)
            elif got:
                moves.extend(got)
        return moves


@dataclass
class DramNeed:
    """Bytes of DRAM a placement needs, by what holds them."""

    param_homes_bytes: int  # DRAM param homes (and resident working copies on a CPU device)
    optim_homes_bytes: int  # fp32 master + moments + gradient accumulators kept in DRAM
    working_bytes: int  # params materialised at once, gradient and optimizer buffers in flight
    staging_bytes: int  # aligned staging buffers of the NVMe store
    overlap_bytes: int = 0  # prefetch window, optimizer read-ahead and writes in flight (sized
    # from what the budget leaves after the rest; 0 turns the overlap off, never the training)

    @property
    def total_bytes(self) -> int:
        return (self.param_homes_bytes + self.optim_homes_bytes + self.working_bytes
                + self.staging_bytes + self.overlap_bytes)

    @property
    def minimum_bytes(self) -> int:
        """What even an all-NVMe placement would need: the working set and the staging pool."""
        return self.working_bytes + self.staging_bytes


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def check_budget(need: DramNeed, budget_bytes: int | None) -> None:
    """Raise :class:`BudgetError` when ``need`` does not fit ``budget_bytes`` (None = no budget)."""
    if budget_bytes is None or need.total_bytes <= budget_bytes:
        return
    homes = need.param_homes_bytes + need.optim_homes_bytes
    if need.minimum_bytes > budget_bytes:
        raise BudgetError(
            f"zinf.dram_budget {fmt_bytes(budget_bytes)} is below the minimum working set "
            f"{fmt_bytes(need.minimum_bytes)} (params in use at once {fmt_bytes(need.working_bytes)}, "
            f"staging buffers {fmt_bytes(need.staging_bytes)}); raise dram_budget to at least "
            f"{fmt_bytes(need.minimum_bytes)} or lower zinf.chunk_size / offload buffer sizes"
        )
    raise BudgetError(
        f"the placement needs {fmt_bytes(need.total_bytes)} of DRAM (homes {fmt_bytes(homes)}, "
        f"working set {fmt_bytes(need.minimum_bytes)}) but zinf.dram_budget is {fmt_bytes(budget_bytes)}; "
        f"raise dram_budget, or put more state on NVMe (offload_param/offload_optimizer device 'nvme', "
        f"a smaller max_in_cpu, fewer 'cpu' pins)"
    )
