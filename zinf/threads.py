"""zinf's own threads run torch's CPU operations single-threaded.

Why: PyTorch's CPU kernels parallelise through OpenMP, and every *thread* that runs a large enough
operation gets an OpenMP team of its own (``torch.get_num_threads()`` threads). zinf's I/O threads
copy through staging buffers (``Tensor.copy_`` of up to a block, large enough to be parallel) and
its optimizer worker runs updates during backward; each of them would start a second team beside
the training thread's. Once the process's OpenMP threads outnumber the cores, GNU libgomp stops
spin-waiting between parallel regions (its "throttled" spin count), and every one of the thousands
of small parallel regions of a training step then pays a futex wake-up: on the 2-core development
VM a dense GPT step went from 0.58 s to 0.77 s for the rest of the run as soon as write-behind
had once run (``benchmarks/RESULTS.md``, "OpenMP teams"). The training thread keeps all the cores.

:func:`single_threaded_torch` limits the calling thread only (OpenMP's thread count is a
per-thread setting; ``torch.set_num_threads`` would change the process-wide default as well), through
threadpoolctl, which finds the OpenMP runtime torch loaded, and MKL's own per-thread count (its
vector math - ``sqrt`` in an Adam update - starts teams of its own) where torch is built with MKL.
Call it first thing in a thread zinf starts (``ThreadPoolExecutor(initializer=single_threaded_torch)``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache

import torch

log = logging.getLogger("zinf")

__all__ = ["single_threaded_torch"]

_warned = False


def single_threaded_torch() -> None:
    """Make torch's CPU operations on the calling thread run on that thread alone."""
    global _warned
    # torch sets a thread's OpenMP thread count from its process-wide default at the thread's
    # first parallel operation; run that initialisation now, so that it cannot undo the limit.
    torch.get_num_threads()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        if not _warned:
            _warned = True
            log.warning("threadpoolctl is not installed: zinf's I/O threads may run torch copies on an "
                        "OpenMP team of their own, which slows training on machines with few cores; "
                        "pip install threadpoolctl")
        return
    threadpool_limits(limits=1, user_api="openmp")  # this thread's OpenMP setting only
    mkl_local = _mkl_set_num_threads_local()
    if mkl_local is not None:
        mkl_local(1)


@cache
def _mkl_set_num_threads_local():
    """MKL's ``mkl_set_num_threads_local`` (per thread), from the MKL linked into torch's CPU
    library; None where torch has no MKL (or keeps it elsewhere). The C function's symbol is
    ``MKL_Set_Num_Threads_Local`` (mkl_service.h); the lower-case symbol is the Fortran one,
    which takes a pointer."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn
