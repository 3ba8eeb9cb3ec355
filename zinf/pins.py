"""Per-module placement pins: ``module_parameters`` patterns matched against module names.

A pin says "the tensors of these modules live on this tier", overriding the planner::

    "module_parameters": {
        "encoder.layer[0-2]": {"device": "cpu"},
        "encoder.layer[3-]":  {"device": "nvme"},
        "blocks.*.mlp":       {"device": "gpu"}
    }

Pattern grammar: a dotted module name, anchored at the root module, where

* a segment may end in an index list ``[...]``, which matches one more name component that is a
  non-negative integer: ``layer[0-2]`` matches ``layer.0``, ``layer.1``, ``layer.2``. The list is
  comma-separated items ``N``, ``N-M``, ``N-`` (N and up) and ``-M`` (0..M): ``layer[1,3,5-7]``.
  A bare ``[0-3]`` segment matches an integer component by itself (children of an
  ``nn.Sequential`` root);
* a segment may use shell globs ``*`` and ``?`` (never crossing a dot): ``blocks.*.mlp``,
  ``*.experts.*``. Square brackets always mean index lists, never fnmatch character classes.

A pattern matches a module and all its descendants. When several patterns match, the most
specific wins: the one that matched the most name components (``layer[0-2]`` counts two); ties go
to the later pattern in dict order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from pydantic import ValidationError

from zinf.config import PinConfig
from zinf.errors import ConfigError

__all__ = ["Pin", "PinSet", "parse_pattern"]

_EXAMPLES = (
    "valid patterns look like 'encoder.layer[0-2]', 'encoder.layer[3-]', 'layers[1,3,5]' or 'blocks.*.mlp'"
)
_SEGMENT_RE = re.compile(r"(?P<name>[^\[\]]*)(?:\[(?P<spec>[^\[\]]*)\])?")
_ITEM_RE = re.compile(r"(?P<lo>\d+)?\s*(?P<dash>-)?\s*(?P<hi>\d+)?")

# One token matches one module-name component: a glob string, or a tuple of index ranges
# (lo, hi) with hi None for "and up".
Token = str | tuple[tuple[int, int | None], ...]


def _bad(pattern: str, why: str) -> ConfigError:
    return ConfigError(f"invalid module pattern {pattern!r}: {why}; {_EXAMPLES}")


def _split_segments(pattern: str) -> list[str]:
    """Split on dots outside brackets, checking that brackets balance and do not nest."""
    segments, current, depth = [], [], 0
    for ch in pattern:
        if ch == "[":
            if depth:
                raise _bad(pattern, "nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _bad(pattern, "']' without a matching '['")
            depth = 0
        elif ch == "." and depth:
            raise _bad(pattern, "'.' inside an index list")
        if ch == "." and not depth:
            segments.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise _bad(pattern, "'[' without a matching ']'")
    segments.append("".join(current))
    return segments


def _parse_spec(pattern: str, spec: str) -> tuple[tuple[int, int | None], ...]:
    ranges: list[tuple[int, int | None]] = []
    for item in spec.split(","):
        m = _ITEM_RE.fullmatch(item.strip())
        if not item.strip() or m is None or (m["dash"] is None and m["hi"] is not None):
            raise _bad(
                pattern, f"index list [{spec}] has an item {item.strip()!r} that is not N, N-M, N- or -M"
            )
        if m["dash"] is None:
            lo = hi = int(m["lo"])
        else:
            if m["lo"] is None and m["hi"] is None:
                raise _bad(pattern, f"index list [{spec}] has a bare '-'")
            lo = int(m["lo"]) if m["lo"] is not None else 0
            hi = int(m["hi"]) if m["hi"] is not None else None
        if hi is not None and lo > hi:
            raise _bad(pattern, f"index range {lo}-{hi} is empty (start > end)")
        ranges.append((lo, hi))
    return tuple(ranges)


def parse_pattern(pattern: str) -> tuple[Token, ...]:
    """Parse a pin pattern into one token per module-name component; ConfigError if invalid."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise _bad(str(pattern), "a pattern must be a non-empty module name")
    if pattern != pattern.strip() or any(ch.isspace() for ch in pattern):
        raise _bad(pattern, "whitespace is not allowed")
    tokens: list[Token] = []
    for segment in _split_segments(pattern):
        m = _SEGMENT_RE.fullmatch(segment)
        if m is None:
            raise _bad(pattern, f"segment {segment!r} has text after its index list")
        name, spec = m["name"], m["spec"]
        if not name and spec is None:
            raise _bad(pattern, "empty segment (two dots in a row, or a leading or trailing dot)")
        if name:
            tokens.append(name)
        if spec is not None:
            tokens.append(_parse_spec(pattern, spec))
    return tuple(tokens)


def _match_length(tokens: tuple[Token, ...], parts: list[str]) -> int | None:
    """Components of ``parts`` matched by ``tokens`` (as a prefix), or None if no match."""
    if len(parts) < len(tokens):
        return None
    for token, part in zip(tokens, parts):
        if isinstance(token, str):
            if not fnmatchcase(part, token):
                return None
        else:
            if not (part.isascii() and part.isdigit()):
                return None
            n = int(part)
            if not any(lo <= n and (hi is None or n <= hi) for lo, hi in token):
                return None
    return len(tokens)


@dataclass(frozen=True)
class Pin:
    """One parsed ``module_parameters`` entry."""

    pattern: str
    tier: str  # "gpu" | "cpu" | "nvme"
    tokens: tuple[Token, ...]

    def match_length(self, module_name: str) -> int | None:
        """Name components this pin matches in ``module_name`` (a prefix), or None."""
        return _match_length(self.tokens, module_name.split(".") if module_name else [])


def _tier(pattern: str, value: Any) -> str:
    if isinstance(value, PinConfig):
        return value.device
    try:
        return PinConfig.model_validate(value).device
    except ValidationError:
        raise ConfigError(
            f"module_parameters[{pattern!r}] must be {{\"device\": \"gpu\"|\"cpu\"|\"nvme\"|\"none\"}} "
            f"or one of those strings, got {value!r}"
        ) from None


class PinSet:
    """The pins of one ``module_parameters`` mapping, answering "which tier is this module pinned to"."""

    def __init__(self, pins: Iterable[Pin] = ()) -> None:
        self.pins: tuple[Pin, ...] = tuple(pins)
        self._cache: dict[str, Pin | None] = {}

    @classmethod
    def from_config(cls, module_parameters: Mapping[str, PinConfig | dict[str, Any] | str] | None) -> PinSet:
        """Parse ``{pattern: PinConfig | {"device": ...} | "cpu"}``.

        Raises ConfigError on a bad pattern or device."""
        if module_parameters is None:
            return cls()
        if not isinstance(module_parameters, Mapping):
            raise ConfigError(
                "module_parameters must be an object mapping module-name patterns to "
                f'{{"device": ...}}, got {type(module_parameters).__name__}'
            )
        return cls(Pin(p, _tier(p, v), parse_pattern(p)) for p, v in module_parameters.items())

    def match(self, module_name: str) -> Pin | None:
        """The pin that applies to ``module_name`` (most specific; ties -> later), or None."""
        if module_name in self._cache:
            return self._cache[module_name]
        best: Pin | None = None
        best_len = -1
        for pin in self.pins:
            n = pin.match_length(module_name)
            if n is not None and n >= best_len:
                best, best_len = pin, n
        self._cache[module_name] = best
        return best

    def tier_for(self, module_name: str) -> str | None:
        """"gpu", "cpu" or "nvme" if a pin applies to ``module_name`` (or an ancestor), else None."""
        pin = self.match(module_name)
        return pin.tier if pin is not None else None

    def tier_for_param(self, param_fqn: str) -> str | None:
        """The pin tier of the module owning ``param_fqn`` (the fqn minus its last component)."""
        return self.tier_for(param_fqn.rpartition(".")[0])

    def patterns_matching_nothing(self, module_names: Iterable[str]) -> list[str]:
        """Patterns (in dict order) that match none of ``module_names`` - most likely typos."""
        names = list(module_names)
        return [pin.pattern for pin in self.pins if not any(pin.match_length(n) is not None for n in names)]

    def __len__(self) -> int:
        return len(self.pins)

    def __bool__(self) -> bool:
        return bool(self.pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(self.pins)

    def __repr__(self) -> str:
        inner = ", ".join(f"{p.pattern!r}: {p.tier!r}" for p in self.pins)
        return f"PinSet({{{inner}}})"
