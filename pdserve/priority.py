"""Scheduling priority of engine workers and routers.

Ray starts its worker processes at niceness 15 (its ``worker_niceness`` setting), so on a small machine an
engine yields the CPU to every ordinary process, a benchmark client included, and a router next to busy
engines gets the CPU so rarely that tokens wait in it for seconds. Our workers and router processes ask for
niceness 0 again when they start (``restore_normal_priority``); that needs the right to raise a priority
(root, ``CAP_SYS_NICE`` or a ``nice`` resource limit of 20), and without it the worker keeps Ray's niceness.
A cluster started with ``RAY_worker_niceness=0`` in the environment (``pdserve serve`` sets it for the local
cluster it starts) starts its workers at niceness 0 with no privilege at all. The engine workers' OpenMP
threads get ``GOMP_SPINCOUNT`` the same way (``DeploymentConfig.omp_spin_count``): how long they wait for
the next parallel kernel before they sleep.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
OMP_SPIN_COUNT_ENV = "GOMP_SPINCOUNT"  # how long libgomp's threads wait for work before they sleep


def restore_normal_priority() -> int:
    """Set every thread of this process to niceness 0 where it is higher and permitted; returns the niceness
    of the calling thread afterwards. Linux keeps a niceness per thread and new threads inherit their
    creator's, so each existing thread is set."""
    if not hasattr(os, "setpriority"):
        return 0
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError:
            log.warning(
                "process runs at niceness %d: no permission to raise its priority (start the Ray cluster "
                "with %s=0 to avoid this)",
                os.getpriority(os.PRIO_PROCESS, 0),
                RAY_WORKER_NICENESS_ENV,
            )
            break
        except ProcessLookupError:  # the thread has ended
            continue
    return os.getpriority(os.PRIO_PROCESS, 0)
