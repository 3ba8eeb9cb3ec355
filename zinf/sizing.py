"""What a placement needs in DRAM, and which overlap buffers the DRAM budget leaves it.

The engine asks this of its own placement: the budget check at ``initialize``, the buffers it
re-sizes after a migration, the check before each move. A planner asks it of placements it
only considers. :class:`DramSizing` holds just the sizes and settings the answers depend on (no
tensor, no module), so asking never touches the engine's state, and the planner can copy it to
its own process (``pickle``) and ask there while training runs.

Placements are given as ``places``: one :class:`ShardPlacement` per shard, in shard order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zinf.placement import DramNeed, ShardPlacement


@dataclass(frozen=True)
class ShardSizes:
    """One shard's bytes and the facts about it that sizing needs."""

    name: str
    param_bytes: int
    """The working copy, in the compute dtype."""
    optim_bytes: int
    """fp32 master and moments (0 for a frozen shard)."""
    grad_bytes: int
    """fp32 gradient accumulator (0 for a frozen shard)."""
    trainable: bool
    chunked: bool
    """Several parameters in one shard: their gradients wait in DRAM until backward ends."""


@dataclass(frozen=True)
class Overlap:
    """DRAM granted to overlapping I/O with compute (see :meth:`DramSizing.overlap`)."""

    write_bytes: int
    """Bytes of NVMe writes that may be in flight behind compute (0: writes are synchronous)."""
    read_ahead_bytes: int
    """One optimizer group read ahead of its update (0: ``pipeline_read`` off)."""
    eager_bytes: int
    """Groups held by updates running during backward."""
    prefetch_bytes: int
    """The parameter prefetch window (0: prefetch off)."""
    eager: bool
    """Whether shards are updated during backward (clipping off, ``zinf.overlap_optimizer``)."""

    @property
    def total_bytes(self) -> int:
        return self.write_bytes + self.read_ahead_bytes + self.eager_bytes + self.prefetch_bytes


@dataclass(frozen=True)
class DramSizing:
    """An engine's DRAM arithmetic, detached from the engine."""

    shards: tuple[ShardSizes, ...]
    chains: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """Per module: the indices of the shards of it and its ancestors, and of its own."""
    on_cpu: bool
    """Compute on the CPU: DRAM and the ``gpu`` tier are the same memory."""
    fp32: bool
    """Compute dtype float32: on the CPU a DRAM working copy can be the master itself."""
    staging_bytes: int
    """The NVMe store's aligned staging pool (``staging_buffers`` x ``staging_buffer_size``)."""
    pipeline_write: bool
    """``offload_optimizer.pipeline_write``: writes in flight behind compute."""
    pipeline_read: bool
    """``offload_optimizer.pipeline_read``: one optimizer group read ahead."""
    eager_wanted: bool
    """Updates during backward asked for and allowed (``zinf.overlap_optimizer``, no clipping, no fp16)."""

    def places_of(self, placement: Mapping[str, Mapping[str, str]], current: Sequence[ShardPlacement]) -> list[ShardPlacement]:
        """``current`` with the shards named in ``placement`` ({shard: {"param": tier, "optim":
        tier}}) moved as it says."""
        out = list(current)
        for i, sh in enumerate(self.shards):
            tiers = placement.get(sh.name)
            if tiers is not None:
                out[i] = ShardPlacement(tiers.get("param", out[i].param), tiers.get("optim", out[i].optim))
        return out

    def aliases_master(self, i: int, place: ShardPlacement) -> bool:
        """Shard ``i``'s fp32 working copy and master in the same DRAM: one tensor serves both.
        On the CPU device that tensor is the parameter itself; with a GPU computing it is the
        DRAM home uploads read from (page-locked), which the update rewrites in place."""
        dram = ("cpu", "gpu") if self.on_cpu else ("cpu",)
        return self.shards[i].trainable and self.fp32 and place.param in dram and place.optim in dram

    def need(self, places: Sequence[ShardPlacement]) -> DramNeed:
        """The DRAM need (homes, working set, staging; no overlap buffers) of ``places``."""
        dram_tiers = ("cpu", "gpu") if self.on_cpu else ("cpu",)
        param_homes = optim_homes = 0
        largest_nvme_group = 0
        nvme_chunk_grads = 0
        for i, (sh, place) in enumerate(zip(self.shards, places)):
            if place.param in dram_tiers and not self.aliases_master(i, place):
                param_homes += sh.param_bytes
            if place.optim in dram_tiers:
                optim_homes += sh.optim_bytes + sh.grad_bytes
            elif place.optim == "nvme":
                largest_nvme_group = max(largest_nvme_group, sh.optim_bytes + 2 * sh.grad_bytes)
                if sh.chunked:
                    nvme_chunk_grads += sh.grad_bytes  # chunk grads wait in DRAM until backward ends
        # Params materialised at once: a module's shards plus those of its ancestors, plus one
        # more module's worth held until the end of backward (a first layer whose inputs need
        # no grad gets no backward-done hook).
        live = self.live_param_bound(places) + sum(
            sh.param_bytes for sh, place in zip(self.shards, places) if sh.chunked and place.param == "nvme")
        staging = self.staging_bytes if any(p.param == "nvme" or p.optim == "nvme" for p in places) else 0
        return DramNeed(
            param_homes_bytes=param_homes,
            optim_homes_bytes=optim_homes,
            working_bytes=(live if self.on_cpu else 0) + largest_nvme_group + nvme_chunk_grads,
            staging_bytes=staging,
        )

    def live_param_bound(self, places: Sequence[ShardPlacement]) -> int:
        """Upper bound (bytes) of non-resident params materialised at the same time."""
        def fetched(i: int) -> int:
            param = places[i].param
            resident = param == "gpu" or (self.on_cpu and param == "cpu")
            return 0 if resident else self.shards[i].param_bytes

        worst = largest = 0
        for chain, own in self.chains:
            worst = max(worst, sum(fetched(i) for i in chain))
            largest = max(largest, sum(fetched(i) for i in own))
        return worst + largest

    def largest_nvme_group_bytes(self, places: Sequence[ShardPlacement]) -> int:
        """Bytes of the largest optimizer group (master, moments, gradient) homed on NVMe."""
        return max((sh.optim_bytes + sh.grad_bytes for sh, p in zip(self.shards, places) if p.optim == "nvme"), default=0)

    def overlap(self, places: Sequence[ShardPlacement], budget_bytes: int | None, prefetch_wanted_bytes: int,
                need: DramNeed | None = None) -> Overlap:
        """How much DRAM the overlap of I/O with compute may use with ``places``, and which kinds
        are on.

        Wanted: a window of writes in flight (two optimizer groups, so that write-back never
        blocks the next update), one optimizer group read ahead (``pipeline_read``), two groups
        for updates running during backward (``zinf.overlap_optimizer``), and the parameter
        prefetch window (``prefetch_wanted_bytes``). Under a budget they get what the placement
        leaves (``need``, default :meth:`need` of ``places``), in that order; what does not fit
        is switched off (training stays correct, it is only slower).
        """
        need = need or self.need(places)
        any_nvme_optim = any(p.optim == "nvme" for p in places)
        any_nvme_param = any(p.param == "nvme" for p in places)
        group = self.largest_nvme_group_bytes(places)
        left = None if budget_bytes is None else budget_bytes - need.total_bytes

        def grant(want: int) -> int:
            nonlocal left
            if left is None:
                return want
            got = want if want <= left else 0
            left -= got
            return got

        write = grant(2 * group) if any_nvme_optim and self.pipeline_write else 0
        read_ahead = grant(group) if any_nvme_optim and self.pipeline_read else 0
        eager = grant(3 * group) if self.eager_wanted and any_nvme_optim else 0  # two updates queued, one group read ahead
        prefetch = 0
        if any_nvme_param and prefetch_wanted_bytes > 0:
            prefetch = prefetch_wanted_bytes if left is None else max(0, min(prefetch_wanted_bytes, left))
            # a window smaller than the largest shard could never hold a read
            largest = max((sh.param_bytes for sh, p in zip(self.shards, places) if p.param == "nvme"), default=0)
            prefetch = prefetch if prefetch >= largest else 0
        return Overlap(write_bytes=write, read_ahead_bytes=read_ahead, eager_bytes=eager, prefetch_bytes=prefetch,
                       eager=eager > 0)
