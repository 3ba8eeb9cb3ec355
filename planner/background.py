"""A Python process of its own for planning, so that a plan's CPU seconds do not stall training.

A plan reads the profile, fits the cost model, runs the MILP over several splits of the budget
and simulates its candidates: 0.1-1.5 s of pure-Python and pandas work on 2 cores. On the
training thread that is a stalled step; on another thread of the same process it holds the GIL
that the training thread's module hooks and I/O callbacks need, so the step runs as slowly as
if it had waited (measured on the dense GPT at 20%: a planning-sized load every 8 steps cost
11% of the mean step inline and 11% on a thread, 5% in a child process at ``nice`` +10).

:class:`PlanningProcess` starts ``python -m planner.background`` with the parent's ``sys.path``
(not ``multiprocessing``: its ``spawn`` and ``forkserver`` start methods import the parent's
``__main__`` again, which re-runs a training script without a ``__name__`` guard). Requests go
over the child's stdin as pickles of ``(function, args)``, answers come back over a pipe of
their own as ``("ok", result)`` or ``("error", message)``. The child runs under Linux's
``SCHED_IDLE`` policy (elsewhere: ``nice`` +10; set by the parent as it starts, so that its
imports, ~2 CPU seconds, are already low-priority) and uses one thread for numeric libraries: it
takes only the CPU time training leaves. (On the MoE benchmark at 30%, a plan of 1-1.5 s made
there at ``nice`` +10 still slowed the steps it overlapped by up to 2x; under ``SCHED_IDLE`` the
median and mean step were below those of planning between steps.) At the lag limit the training
thread waits, and the child then has the CPUs to itself. With fewer than 4 CPUs the controller
plans between steps by default (``ControllerSettings.plan_lag_steps``): the child has no CPU of
its own there, and at 20% it measured slower (docs/architecture.md). On a machine whose CPUs
other work keeps busy, ``SCHED_IDLE`` gives the child nothing even then: the controller reads
its CPU seconds (:meth:`PlanningProcess.cpu_seconds`) while it waits and makes the plan itself
when the child gets none.
It exits when the parent closes the pipe (the parent exiting, killed or not).
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Callable

__all__ = ["PlanningProcess", "PlanningProcessError", "shared_process", "warm_up"]

NICE_INCREMENT = 10
"""How much the parent lowers the child's CPU priority where ``SCHED_IDLE`` is not available."""

IN_PLANNING_PROCESS = False
"""True in the planning process itself (set by its loop)."""


class PlanningProcessError(RuntimeError):
    """The planning process failed: it died (``died``), or a request raised there (the message
    says what)."""

    def __init__(self, message: str, died: bool = False) -> None:
        super().__init__(message)
        self.died = died


class PlanningProcess:
    """One child Python process that runs picklable functions, one request at a time.

    ``idle``: the child runs only on CPU time nothing else wants (``SCHED_IDLE``, else ``nice``
    +10); False runs it at this process's priority (tests that check what it computes, not how
    it is scheduled, on a machine other work may load)."""

    def __init__(self, executable: str | None = None, idle: bool = True) -> None:
        self.executable = executable or sys.executable  # the Python the child runs
        self.idle = idle
        self._proc: subprocess.Popen | None = None
        self._answers = None  # the read end of the child's answer pipe (a file)
        self._lock = threading.Lock()  # one request at a time, whichever thread asks
        self._busy = False  # a request is with the child

    @property
    def busy(self) -> bool:
        """Whether a request is with the child now (sent, not yet answered)."""
        return self._busy

    @property
    def pid(self) -> int | None:
        """The child's process id (None before it is started or after it stopped)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> None:
        """Start the child unless it runs (returns at once; it imports while the parent goes on)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        read_fd, write_fd = os.pipe()  # answers: the child's stdout stays free for stray prints
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        try:
            self._proc = subprocess.Popen(
                [self.executable, "-m", "planner.background", str(write_fd)],
                stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env, close_fds=True)
        finally:
            os.close(write_fd)
        if self.idle:  # at once, so that its imports (~2 CPU seconds) already run on idle CPU only
            _lower_priority(self._proc.pid)
        self._answers = os.fdopen(read_fd, "rb")

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the child; blocks until it answers. ``fn`` must be importable by name
        (a module-level function) and ``args`` and the result picklable. Raises
        :class:`PlanningProcessError` when the child dies or ``fn`` raised there."""
        with self._lock:
            self._start()
            self._busy = True
            try:
                pickle.dump((fn, args), self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self._proc.stdin.flush()
                status, value = pickle.load(self._answers)
            except (BrokenPipeError, EOFError, OSError) as e:
                code = self._proc.poll()
                self._stop()
                raise PlanningProcessError(f"the planning process stopped (exit code {code}): {type(e).__name__}",
                                           died=True) from None
            finally:
                self._busy = False
        if status != "ok":
            raise PlanningProcessError(value)
        return value

    def stop(self) -> None:
        """Close the child's pipe and wait for it to exit (killed after 5 s); a request still
        with it (another thread waiting for its answer) is ended by killing it. Idempotent."""
        if not self._lock.acquire(timeout=1.0):
            self.kill()  # that thread's call raises PlanningProcessError and lets go of the lock
            self._lock.acquire()
        try:
            self._stop()
        finally:
            self._lock.release()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if self._answers is not None:
            self._answers.close()
            self._answers = None

    def cpu_seconds(self) -> float | None:
        """CPU seconds the child has run so far (user + system; Linux's ``/proc``), None where
        that cannot be read (no child, another platform)."""
        pid = self.pid
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                # fields after the parenthesised command name: utime and stime are the 12th and 13th
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """Kill the child at once (a request that never answers); the next call starts another."""
        proc = self._proc
        if proc is not None:
            proc.kill()


def warm_up(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (in the child, before its first real request needs them)."""
    import importlib

    for name in modules:
        importlib.import_module(name)


_shared: PlanningProcess | None = None
_shared_lock = threading.Lock()


def shared_process() -> PlanningProcess:
    """The planning process of this Python process (one for every controller: engines run one
    after another in a benchmark or a test session); stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PlanningProcess()
            atexit.register(_shared.stop)
        return _shared


def _lower_priority(pid: int) -> None:
    """Have process ``pid`` run only when a CPU would otherwise idle (Linux's ``SCHED_IDLE``),
    else at ``nice`` +NICE_INCREMENT; neither needs privileges."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + NICE_INCREMENT)
        except (AttributeError, OSError):  # not on this platform: run at the parent's priority
            pass


def _serve(answer_fd: int) -> None:
    """The child's loop: answer requests from stdin until it closes."""
    global IN_PLANNING_PROCESS
    IN_PLANNING_PROCESS = True
    requests = sys.stdin.buffer
    answers = os.fdopen(answer_fd, "wb")
    while True:
        try:
            fn, args = pickle.load(requests)
        except EOFError:
            return  # the parent closed the pipe or exited
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # everything goes back to the parent, which decides
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # an unpicklable result or exception
            data = pickle.dumps(("error", f"the answer could not be pickled: {type(e).__name__}: {e}"))
        answers.write(data)
        answers.flush()


if __name__ == "__main__":
    # the loop of the module imported by name, not of this __main__ copy: requests read its globals
    from planner import background

    background._serve(int(sys.argv[1]))
