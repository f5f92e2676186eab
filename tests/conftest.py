"""Suite-wide set-up: without a GPU, Triton kernels run under Triton's interpreter, and each test
process keeps to its share of the CPU cores.

``TRITON_INTERPRET`` must be set before a kernel module is imported (``triton.jit`` picks the
interpreter when a kernel is defined), so it is set here, before any test module loads.

Threads: PyTorch's CPU ops use one OpenMP thread per core by default. Under pytest-xdist
(``make test`` runs ``-n 2``) every worker would do so, and 2 workers x 2 threads on 2 cores spin
against each other: measured on the 2-core machine, a tiny-model forward loop in two processes at
once took 40 s with 2 threads each and 2 s with 1 thread each. So each process gets
``cores // workers`` threads (at least 1), unless ``OMP_NUM_THREADS`` is set; the variable is set
too, for the subprocesses that tests start (docs snippets, example plugins, sweeps).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _threads_per_process() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, cores // max(1, workers))


# the variable is left alone in xdist's controller, whose environment the workers inherit
if "OMP_NUM_THREADS" not in os.environ or os.environ.get("_ELASTICFW_TEST_THREADS") == os.environ["OMP_NUM_THREADS"]:
    threads = _threads_per_process()
    torch.set_num_threads(threads)
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["OMP_NUM_THREADS"] = os.environ["_ELASTICFW_TEST_THREADS"] = str(threads)
