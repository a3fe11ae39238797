"""Placement on a real Ray cluster: workers land on the nodes of their role, and workers sharing a GPU see it."""

from __future__ import annotations

import time

import pytest
import ray

from pdserve.cli.main import format_status
from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.placement import (
    DECODE,
    PREFILL,
    PlacementError,
    cluster_nodes,
    device_in_this_worker,
    node_label,
    plan_placement,
)
from pdserve.router.client import Client

ENGINE = EngineConfig(model="tiny", device="cpu", num_kv_blocks=128, torch_threads=1, max_model_len=512)


@pytest.mark.cluster
def test_deployment_places_by_role_reports_nodes_and_fails_fast():
    ray.init(num_cpus=2, resources={"decode": 1, "prefill": 1}, include_dashboard=False, log_to_driver=False)
    try:
        config = DeploymentConfig(engine=ENGINE, mode="disaggregated", num_prefill_workers=1, port=0, verify_kv=True)
        with Deployment(config) as d:
            free = ray.available_resources()
            assert free.get("prefill", 0) == 0 and free.get("decode", 0) == 0  # each worker holds its unit
            (node,) = [n for n in ray.nodes() if n["Alive"]]
            label = node_label(node["NodeManagerAddress"], node["NodeID"])
            infos = ray.get([w.actor.ready.remote() for w in d.workers])
            assert [i["node"] for i in infos] == [label, label]
            with Client(d.address) as client:
                tokens = [t for c in client.generate([5, 6, 7, 8], SamplingParams(max_tokens=4)) for t in c.token_ids]
                assert len(tokens) == 4
                stats = client.stats()
            assert {(w.role, w.node, w.device) for w in stats} == {
                ("prefill", label, "cpu"),
                ("decode", label, "cpu"),
            }
            assert len(format_status(stats).splitlines()) == 3
            # The units are taken: a second deployment cannot start and says why, at once.
            start = time.monotonic()
            with pytest.raises(PlacementError, match=r"'decode': 1 needed, 0 free"):
                Deployment(DeploymentConfig(engine=ENGINE, port=0)).start()
            assert time.monotonic() - start < 15
        start = time.monotonic()
        too_many = DeploymentConfig(engine=ENGINE, mode="disaggregated", num_prefill_workers=2, port=0)
        with pytest.raises(PlacementError, match=r"cannot place 2 prefill workers.*1 'prefill' in total, 2 needed"):
            Deployment(too_many).start()
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 10  # nothing half-started holds a unit once the first deployment stopped
        while ray.available_resources().get("prefill", 0) < 1 or ray.available_resources().get("decode", 0) < 1:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.1)
    finally:
        ray.shutdown()


@pytest.mark.cluster
def test_workers_sharing_a_gpu_see_it_and_map_cuda_n_to_it():
    """Ray's side of --gpus-per-worker and --device cuda:N: fractional actors share GPU 0, each sees it
    as CUDA_VISIBLE_DEVICES=0, and cuda:N is read against that inside the actor (no CUDA here, so the
    mapping ends at CUDA's device count)."""
    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        placement = plan_placement(cluster_nodes(), 1, 2, True, 0.25)

        class Probe:
            def device(self, device: str) -> tuple[str | None, str]:
                import os

                try:
                    return os.environ.get("CUDA_VISIBLE_DEVICES"), device_in_this_worker(device)
                except ValueError as e:
                    return os.environ.get("CUDA_VISIBLE_DEVICES"), f"refused: {e}"

        probe = ray.remote(Probe)
        actors = [probe.options(**placement.actor_options(r)).remote() for r in (PREFILL, DECODE, DECODE)]
        answers = ray.get([a.device.remote("cuda:0") for a in actors], timeout=60)
        assert ray.available_resources().get("GPU") == pytest.approx(0.25)  # three quarters held
        assert [visible for visible, _ in answers] == ["0", "0", "0"]
        assert all(answer.startswith("refused: device 'cuda:0': GPU 0 is visible") for _, answer in answers)
        [(_, other)] = ray.get([actors[0].device.remote("cuda:1")], timeout=60)
        assert other.startswith("refused: device 'cuda:1': Ray gave this worker GPU 0, not GPU 1")
        [(_, plain)] = ray.get([actors[0].device.remote("cuda")], timeout=60)
        assert plain == "cuda"
    finally:
        ray.shutdown()
