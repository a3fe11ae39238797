"""Engine workers and routers ask for normal priority again (Ray starts worker processes at niceness 15)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

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


def _thread_niceness(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}


@pytest.mark.cluster
def test_the_router_and_the_workers_of_a_deployment_run_at_normal_priority_in_a_cluster_of_niced_workers(
    ray_cluster,
):
    """In a Ray cluster started at Ray's default worker niceness (15), every thread of the router process
    and of the engine workers runs at niceness 0: a niced router next to two busy engines on 2 cores held
    each token for up to seconds. The engine workers start with the deployment's OpenMP spin count."""
    import ray

    from pdserve.deployment import Deployment, DeploymentConfig
    from pdserve.engine import EngineConfig

    @ray.remote(num_cpus=0)
    def ray_worker_niceness() -> int:
        return os.nice(0)

    expected = 0 if _may_raise_priority() else ray.get(ray_worker_niceness.remote(), timeout=60)
    engine = EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, torch_threads=1, max_model_len=256)
    config = DeploymentConfig(engine=engine, num_prefill_workers=1, num_decode_workers=1, omp_spin_count=12_345)
    with Deployment(config) as d:
        pids = {"router": d.router_usage()[0]["pid"], **{w["worker_id"]: w["pid"] for w in d.worker_info}}
        niceness = {name: _thread_niceness(pid) for name, pid in pids.items()}
        spin_counts = {w["worker_id"]: psutil.Process(w["pid"]).environ().get("GOMP_SPINCOUNT") for w in d.worker_info}
    assert niceness == {name: {expected} for name in pids}, niceness
    assert spin_counts == {"prefill-0": "12345", "decode-0": "12345"}


def test_the_spin_count_is_an_option_of_serve_and_never_negative():
    from pdserve.cli.main import build_parser
    from pdserve.deployment_config import DEFAULT_OMP_SPIN_COUNT, DeploymentConfig
    from pdserve.options import config_from_args

    serve = build_parser().parse_args(["serve"])
    assert config_from_args(DeploymentConfig, serve).omp_spin_count == DEFAULT_OMP_SPIN_COUNT
    serve = build_parser().parse_args(["serve", "--omp-spin-count", "0"])
    assert config_from_args(DeploymentConfig, serve).omp_spin_count == 0
    with pytest.raises(ValueError, match="omp_spin_count must be >= 0, got -1"):
        DeploymentConfig(omp_spin_count=-1)
