"""What a model may tell zinf about its own next steps: ``zinf.will_use(modules)``; and which open
engine wraps a module (one model, one open engine: a second would free the first's parameters).

A routed model knows which modules a pass runs only once it has routed: an MoE layer learns its
experts from the router, a moment before it calls them. The recorded trace cannot know that, so
without a word from the model each seldom-used expert on NVMe is read when it is called (a miss
the training thread waits for). A model that calls ``zinf.will_use(experts)`` right after routing
has those reads started at once, side by side, while the experts before them compute
(:meth:`zinf.prefetch.Prefetcher.hint`).

The call costs nothing where no engine wraps the modules (plain PyTorch, another framework), so a
model may make it unconditionally. ``zinf.prefetch_hints: false`` makes an engine ignore it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn

# module -> the engine that wraps it (weakly both ways: neither keeps the other alive)
_owners: "weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType]" = weakref.WeakKeyDictionary()


def register(engine, model: nn.Module) -> None:
    """``engine`` wraps ``model``: hints about its modules go to it."""
    ref = weakref.ref(engine)
    for module in model.modules():
        _owners[module] = ref


def open_engine_of(model: nn.Module):
    """The open engine that wraps ``model`` or one of its modules, or None."""
    for module in model.modules():
        ref = _owners.get(module)
        engine = ref() if ref is not None else None
        if engine is not None and not getattr(engine, "_closed", True):
            return engine
    return None


def unregister(model: nn.Module) -> None:
    """The engine wrapping ``model`` is closed: hints about its modules go nowhere (no other open
    engine can wrap them: :func:`open_engine_of` refuses a second)."""
    for module in model.modules():
        _owners.pop(module, None)


def will_use(modules: Iterable[nn.Module]) -> None:
    """The caller is about to run ``modules``, in this order, in the current forward pass (e.g.
    the experts a router just picked): the engine wrapping them reads their parameters from NVMe
    ahead now. Does nothing for modules no open engine wraps."""
    by_engine: dict[int, tuple[object, list[nn.Module]]] = {}
    for module in modules:
        ref = _owners.get(module)
        engine = ref() if ref is not None else None
        if engine is not None:
            by_engine.setdefault(id(engine), (engine, []))[1].append(module)
    for engine, mods in by_engine.values():
        engine.will_use(mods)
