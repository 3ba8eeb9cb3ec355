"""Host <-> device copies of the engine's CUDA path, on side streams ordered by events.

Compute runs on the current (compute) stream. Parameter uploads (host -> device) run on an
``h2d`` stream and gradient downloads (device -> host) on a ``d2h`` stream, so both overlap the
kernels of other modules. Events order them, as FSDP2 orders its all-gathers:

* an upload first waits for the compute work issued so far (its destination was just allocated
  by the caching allocator on the compute stream, and an earlier user of that memory may still
  be running there); the compute stream waits for the upload's event before using the params;
* a download waits for the compute work that produced the gradient; the gradient tensor is
  marked as used by the ``d2h`` stream (``record_stream``), so the allocator does not hand its
  memory out again before the copy is done;
* a pinned host buffer that a copy reads or writes is handed back (``after``) only once the
  copy's event has completed: the CPU must not touch it while the DMA engine does.

Copies are wrapped in ``record_function`` spans (``zinf.h2d`` / ``zinf.d2h``) for the torch
profiler, while it records. Only the training thread calls into this module.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from zinf.spans import span


class Transfers:
    """The side streams of one engine and the work waiting for their events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._waiting: deque[tuple[torch.cuda.Event, Callable[[], None]]] = deque()

    @property
    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def upload(self, pairs: Iterable[tuple[Tensor, Tensor]]) -> torch.cuda.Event:
        """Copy each ``(device destination, pinned host source)`` on the ``h2d`` stream; returns
        the event to wait for before the destinations are used."""
        ready = self.compute.record_event()
        with span("zinf.h2d"), torch.cuda.stream(self.h2d):
            self.h2d.wait_event(ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return self.h2d.record_event()

    def download(self, src: Tensor, dst: Tensor) -> torch.cuda.Event:
        """Copy device tensor ``src`` into pinned host tensor ``dst`` on the ``d2h`` stream, after
        the compute work issued so far; returns the event after which ``dst`` holds the data."""
        with span("zinf.d2h"):
            self.d2h.wait_stream(self.compute)
            with torch.cuda.stream(self.d2h):
                dst.copy_(src, non_blocking=True)
                done = self.d2h.record_event()
            src.record_stream(self.d2h)
        return done

    def use(self, event: torch.cuda.Event) -> None:
        """Make the compute stream wait for ``event`` (an upload) before its next kernels."""
        self.compute.wait_event(event)

    def after(self, event: torch.cuda.Event, callback: Callable[[], None]) -> None:
        """Run ``callback`` (e.g. give a pinned buffer back) once ``event`` has completed."""
        self._waiting.append((event, callback))
        self.reap()

    def reap(self, block: bool = False) -> None:
        """Run the callbacks whose events have completed (all of them, waiting, with ``block``)."""
        while self._waiting and (block or self._waiting[0][0].query()):
            event, callback = self._waiting.popleft()
            event.synchronize()
            callback()

    def synchronize(self) -> None:
        """Wait for every copy issued so far and run the callbacks waiting for them."""
        self.h2d.synchronize()
        self.d2h.synchronize()
        self.reap(block=True)
