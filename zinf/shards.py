"""Cutting a model's parameters into shards, the unit of placement and I/O.

A parameter of at least ``shard_min_bytes`` is a shard of its own. Smaller parameters are packed,
in model order, into chunks of up to ``chunk_size`` bytes so that one I/O moves many of them. A
chunk only holds parameters that agree on everything placement depends on (trainable or frozen,
and the pin of their module), so that one placement decision fits all of its members.

Model order (``named_parameters`` order) is used as the proxy for first-use order: for modules
registered in the order their forward calls them, as in the built-in models, the two agree.
Tied parameters (one ``nn.Parameter`` reachable under several names) are one member with
several names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zinf.errors import ModelError


@dataclass(eq=False)
class Member:
    """One parameter inside a shard: a slice ``[offset, offset + numel)`` of the shard's flat state."""

    param: nn.Parameter
    names: list[str]  # every fully qualified name of this parameter (several when tied)
    offset: int  # in elements, inside the shard's flat buffers
    numel: int
    shape: torch.Size
    index: int  # position in model order among unique parameters (for clipping order)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


@dataclass(eq=False)
class Shard:
    """A group of parameters placed and moved together."""

    index: int
    name: str
    kind: str  # "param", "chunk", "frozen" or "expert"
    members: list[Member] = field(default_factory=list)
    pin: str | None = None  # tier the user pinned the param home to, if any

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def trainable(self) -> bool:
        return self.members[0].trainable

    @property
    def module(self) -> str:
        return self.members[0].name.rpartition(".")[0]


def _kind_of(name: str, trainable: bool, packed: bool, embedding: bool = False) -> str:
    """What the profile and planner call a shard: frozen (no grad, no optimizer state), expert
    (accessed only when routed to), embedding (an ``nn.Embedding`` table, possibly tied to the
    output head), else a packed chunk or a parameter of its own."""
    if not trainable:
        return "frozen"
    if ".experts." in f".{name}":
        return "expert"
    if embedding:
        return "embedding"
    return "chunk" if packed else "param"


def build_shards(
    model: nn.Module,
    *,
    param_bytes_per_elem: int,
    chunk_size: int,
    shard_min_bytes: int,
    pin_for: callable = lambda name: None,
) -> list[Shard]:
    """Cut ``model``'s parameters into shards.

    ``param_bytes_per_elem`` is the size of one element of the working copy (4 for fp32, 2 for
    bf16/fp16): chunk and threshold sizes are measured in those bytes, which is what moves in
    forward and backward. ``pin_for(fqn)`` returns the pinned tier of a parameter or None.
    """
    # Unique parameters in model order, each with all of its names (tied weights).
    names_of: dict[int, list[str]] = {}
    params: list[nn.Parameter] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in names_of:
            names_of[id(p)] = []
            params.append(p)
        names_of[id(p)].append(name)
    if not params:
        raise ModelError("the model has no parameters; zinf has nothing to place or train")
    embedding_tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    shards: list[Shard] = []
    open_chunk: Shard | None = None
    open_key: tuple | None = None
    open_bytes = 0

    def new_shard(kind: str, name: str, pin: str | None) -> Shard:
        s = Shard(index=len(shards), name=name, kind=kind, pin=pin)
        shards.append(s)
        return s

    for index, p in enumerate(params):
        names = names_of[id(p)]
        nbytes = p.numel() * param_bytes_per_elem
        pin = pin_for(names[0])
        if nbytes >= shard_min_bytes:
            kind = _kind_of(names[0], p.requires_grad, packed=False, embedding=id(p) in embedding_tables)
            s = new_shard(kind, names[0], pin)
            s.members.append(Member(p, names, 0, p.numel(), p.shape, index))
            continue
        key = (p.requires_grad, pin)
        if open_chunk is None or key != open_key or open_bytes + nbytes > chunk_size:
            kind = "chunk" if p.requires_grad else "frozen"
            open_chunk = new_shard(kind, f"chunk{len(shards):04d}:{names[0]}", pin)
            open_key, open_bytes = key, 0
        offset = open_chunk.numel
        open_chunk.members.append(Member(p, names, offset, p.numel(), p.shape, index))
        open_bytes += nbytes
    return shards
