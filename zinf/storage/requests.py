"""The threads that run a store's asynchronous requests, what someone waits for first.

A plain thread pool serves requests in the order they were asked for. The engine asks for many
it does not need yet (prefetched params, optimizer groups read ahead, writes behind) and, now and
then, one the training thread waits on this moment: a param read the prefetch did not foresee
(a routed model's expert that the last step did not use), or a group read that was queued behind
the others. In a first-come queue that read waits for every request before it: on a 2-thread
store with a few 0.6 MB requests queued, 4-5 ms instead of the 1-2 ms it takes itself.

:class:`RequestThreads` keeps two classes of request: *urgent* ones, run before any other that
has not started, and the rest, in the order asked. :meth:`RequestThreads.promote` moves a request
already queued to the urgent class, for the moment someone starts waiting for it. Among urgent
requests the order is that of their promotion (or submission).

Nothing here changes what a request does, only when it starts. Callers that need one request to
follow another (a read after the write of the same key) must not make the later one urgent while
the earlier one waits: the store checks that (``NvmeStore.read_async``, ``NvmeStore.hurry``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["RequestThreads"]

URGENT, NORMAL = 0, 1
"""Priorities: lower runs first."""

_live: "weakref.WeakSet[RequestThreads]" = weakref.WeakSet()


def _finish_all_at_exit() -> None:
    """At interpreter exit, like concurrent.futures' pools: run what was asked for, then stop
    (the threads are not daemons, so a write asked for is never cut short)."""
    for requests in list(_live):
        requests.shutdown(wait=True)


# threading's hook runs before the interpreter joins non-daemon threads (concurrent.futures
# registers its own the same way); without it the idle threads would wait forever.
getattr(threading, "_register_atexit", lambda f: None)(_finish_all_at_exit)


class _Request:
    """One asked-for call and its future; ``started`` once a thread took it (a promoted request
    sits in the queue twice: whichever entry comes out first runs it, the other is skipped)."""

    __slots__ = ("future", "fn", "args", "started")

    def __init__(self, future: Future, fn: Callable[..., Any], args: tuple) -> None:
        self.future, self.fn, self.args = future, fn, args
        self.started = False


class RequestThreads:
    """``threads`` worker threads serving urgent requests first (see the module docstring).

    ``initializer`` runs once on each thread before its first request."""

    def __init__(self, threads: int, *, name: str = "zinf-nvme", initializer: Callable[[], None] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._queue: list[tuple[int, int, _Request]] = []  # heap of (priority, order asked, request)
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._stopping = False
        self._initializer = initializer
        self._threads = [threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=False)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        _live.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> Future:
        """Run ``fn(*args)`` on a worker thread; the future resolves to its result or error."""
        future: Future = Future()
        request = _Request(future, fn, args)
        future.zinf_request = request
        with self._wake:
            if self._stopping:
                raise RuntimeError("cannot submit a request after shutdown")
            heapq.heappush(self._queue, (URGENT if urgent else NORMAL, next(self._order), request))
            self._wake.notify()
        return future

    def promote(self, future: Future) -> bool:
        """Run the request of ``future`` before every non-urgent one still queued. Returns False
        when there is nothing to do: it started already (or is not one of these threads')."""
        request = getattr(future, "zinf_request", None)
        with self._wake:
            if request is None or request.started or self._stopping:
                return False
            heapq.heappush(self._queue, (URGENT, next(self._order), request))
        return True

    def shutdown(self, wait: bool = True) -> None:
        """Stop taking requests; the threads run every request asked for so far, then end."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()

    def _next(self) -> _Request | None:
        """The next request to run, or None once stopping with nothing left (blocks meanwhile)."""
        with self._wake:
            while True:
                while self._queue:
                    _, _, request = heapq.heappop(self._queue)
                    if not request.started:  # the other entry of a promoted request ran it
                        request.started = True
                        return request
                if self._stopping:
                    return None
                self._wake.wait()

    def _serve(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (request := self._next()) is not None:
            future, fn, args = request.future, request.fn, request.args
            # the future keeps its request (for promote): let that hold no tensors, no cycle
            request.future = request.fn = request.args = None
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                result = fn(*args)
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(result)
            del request, future, fn, args  # keep no reference on the idle thread
