"""Engine workers ask for normal priority again (Ray starts worker processes at niceness 15)."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.priority import restore_normal_priority

PROBE = """
import os, threading
from pdserve.priority import restore_normal_priority
started = threading.Event()
release = threading.Event()
def worker():
    started.set()
    release.wait()
thread = threading.Thread(target=worker)
thread.start()
started.wait()
print(restore_normal_priority(), os.getpriority(os.PRIO_PROCESS, thread.native_id))
release.set()
"""


def _may_raise_priority() -> bool:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 20


def test_every_thread_of_a_niced_process_returns_to_niceness_0_where_permitted():
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        preexec_fn=lambda: os.nice(15),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    caller, other_thread = (int(n) for n in result.stdout.split())
    if _may_raise_priority():
        assert (caller, other_thread) == (0, 0)
    else:
        assert (caller, other_thread) == (15, 15) and "no permission to raise its priority" in result.stderr


def test_a_process_at_normal_priority_is_left_as_it_is():
    assert restore_normal_priority() == os.getpriority(os.PRIO_PROCESS, 0) == os.nice(0)
