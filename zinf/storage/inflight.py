"""How many whole-file requests are in flight on one disk, averaged over each request's life.

The planner's cost model needs more than "this read took 2 ms": a request that shares the disk
with three others takes longer than the same request alone, and a placement that turns
asynchronous writes into synchronous ones (or back) changes how many share it. So every read and
write of a shard file records its *concurrency*: the time-weighted mean number of requests in
flight on the same disk while it ran, itself included (1.0 = it ran alone).

:class:`InFlight` keeps, per disk, the integral over time of the number of requests in flight
(``area``, request-seconds). A request notes the integral when it starts and when it ends; the
difference divided by its duration is its mean concurrency. Every store on the same device
(``st_dev``: the param and optimizer stores of one engine, two engines of one process) shares one
counter, :func:`for_path`.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["InFlight", "Ticket", "for_path"]


class Ticket:
    """One request's start: the time and the counter's integral then."""

    __slots__ = ("start_s", "area_s")

    def __init__(self, start_s: float, area_s: float) -> None:
        self.start_s = start_s
        self.area_s = area_s


class InFlight:
    """Requests in flight on one disk and the time integral of their number (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._area_s = 0.0  # integral of the count over time, request-seconds
        self._last_s = time.perf_counter()

    def _advance(self, now_s: float) -> None:
        self._area_s += self._count * (now_s - self._last_s)
        self._last_s = now_s

    def enter(self) -> Ticket:
        """A request starts; returns its ticket for :meth:`leave`."""
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            self._count += 1
            return Ticket(now, self._area_s)

    def leave(self, ticket: Ticket) -> tuple[float, float]:
        """The request of ``ticket`` ends; returns ``(seconds, concurrency)``: its duration and
        the mean number of requests in flight while it ran, itself included (>= 1)."""
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            self._count -= 1
            seconds = now - ticket.start_s
            area = self._area_s - ticket.area_s
        concurrency = area / seconds if seconds > 0 else 1.0
        return seconds, max(1.0, concurrency)

    @property
    def count(self) -> int:
        """Requests in flight now."""
        return self._count


_by_device: dict[int, InFlight] = {}
_registry_lock = threading.Lock()


def for_path(path: str | os.PathLike) -> InFlight:
    """The shared counter of the disk (device) that ``path`` lives on."""
    try:
        device = os.stat(Path(path)).st_dev
    except OSError:
        device = -1  # not there yet: one counter for all such paths
    with _registry_lock:
        found = _by_device.get(device)
        if found is None:
            found = _by_device[device] = InFlight()
        return found
