"""The cluster configs: Ray's cluster-config schema, roles, token auth, and what one machine forbids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
RAY_CONFIGS = ["local.yaml", "aws-gpu.yaml"]
SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def start_commands(config: dict) -> list[str]:
    return [*config["head_start_ray_commands"], *config["worker_start_ray_commands"]]


def offered(command: str) -> dict[str, float]:
    """The custom resources a `ray start` command line offers (--resources='{...}')."""
    match = re.search(r"--resources='(\{.*?\})'", command)
    return json.loads(match.group(1)) if match else {}


def test_every_ray_cluster_config_is_here_and_in_the_list():
    ray_configs = sorted(p.name for p in CLUSTER.glob("*.yaml") if "provider" in (yaml.safe_load(p.read_text()) or {}))
    assert ray_configs == sorted(RAY_CONFIGS)


@pytest.mark.parametrize("name", RAY_CONFIGS)
def test_validates_against_rays_cluster_config_schema(name):
    config = load(name)
    jsonschema.validate(config, SCHEMA)  # as written
    validate_config(prepare_config(config))  # as `ray up` sees it, defaults filled in


@pytest.mark.parametrize("name", RAY_CONFIGS)
def test_every_node_starts_ray_with_token_auth_and_gets_the_token(name):
    config = load(name)
    for command in start_commands(config):
        if "ray start" in command:
            assert "RAY_AUTH_MODE=token ray start" in command, command
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert config["file_mounts"]["~/pdserve"] == "."
    assert ".venv" in config["rsync_exclude"]
    assert any("scripts/setup.sh" in c for c in config["setup_commands"])


def test_local_cluster_is_two_loopback_nodes_with_a_role_each_and_no_ray_stop():
    config = load("local.yaml")
    provider = config["provider"]
    assert provider["type"] == "local"
    head, workers = provider["head_ip"], provider["worker_ips"]
    assert head not in workers and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in [head, *workers])
    assert not any("ray stop" in c for c in start_commands(config))  # it would stop the other node too
    (head_start,) = config["head_start_ray_commands"]
    (worker_start,) = config["worker_start_ray_commands"]
    assert f"--node-ip-address={head}" in head_start
    assert f"--node-ip-address={workers[0]}" in worker_start and f"--address={head}:6379" in worker_start
    assert offered(head_start) == {"prefill": 4} and offered(worker_start) == {"decode": 4}


def test_loopback_ssh_script_matches_the_local_cluster():
    config = load("local.yaml")
    script = (CLUSTER / "loopback_ssh.sh").read_text()
    state = re.search(r"^STATE=(\S+)", script, re.M).group(1)
    addrs = re.search(r"^ADDRS=\((.*)\)", script, re.M).group(1).split()
    cluster = re.search(r"^CLUSTER=(\S+)", script, re.M).group(1)
    assert config["auth"]["ssh_private_key"] == f"{state}/id_ed25519"
    assert addrs == [config["provider"]["head_ip"], *config["provider"]["worker_ips"]]
    assert cluster == config["cluster_name"]


def test_aws_cluster_has_a_cpu_head_and_gpu_node_types_per_role():
    config = load("aws-gpu.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {} and head["max_workers"] == 0  # the router's node: no role
    by_role = {next(iter(t["resources"])): t for name, t in types.items() if name != config["head_node_type"]}
    assert set(by_role) == {"prefill", "decode"}
    for role, node_type in by_role.items():
        assert node_type["resources"][role] == 8  # one unit per GPU of the 8-GPU instance types
        assert 1 <= node_type["min_workers"] <= node_type["max_workers"]
    assert config["max_workers"] >= sum(t["max_workers"] for t in by_role.values())
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])


def kuberay_containers(cluster: dict) -> list[dict]:
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_kuberay_cluster_has_a_cpu_head_and_gpu_groups_per_role():
    (cluster,) = [d for d in yaml.safe_load_all((CLUSTER / "kuberay.yaml").read_text()) if d]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__
    head = spec["headGroupSpec"]
    assert "resources" not in head["rayStartParams"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        quoted = group["rayStartParams"]["resources"]
        assert quoted.startswith('"') and quoted.endswith('"')  # KubeRay pastes it into a shell command
        resources = json.loads(quoted[1:-1].replace('\\"', '"'))
        (container,) = group["template"]["spec"]["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert resources == {role: gpus}
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"]
    for container in kuberay_containers(cluster):
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-ray-token"
        assert "$KUBERAY_GEN_RAY_START_CMD" in container["args"][0] and "pip install" in container["args"][0]
