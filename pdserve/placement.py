"""Where pdserve's workers run on a Ray cluster: node roles → Ray actor options, checked before any actor starts.

A node offers a role through a Ray custom resource named after it, ``prefill`` or ``decode``
(``ray start --resources='{"decode": 8}'``; see ``cluster/``). Each worker takes one unit of its role's
resource, so the amount is how many workers of that role the node takes; colocated workers are decode
workers and go to ``decode`` nodes. With the engine on CUDA each worker also takes ``gpus_per_worker``
GPUs: 1 by default (one worker per GPU), a fraction to share a GPU (0.25: four workers on one, so
every mode runs on a single GPU), or a whole number. When no node offers either role, placement is
plain (anywhere, as on a single machine).

``plan_placement`` is pure (nodes in, options out) and raises ``PlacementError`` naming the missing
resource when the cluster's nodes cannot hold the workers, so a deployment fails in seconds instead of
leaving actors pending forever. ``place_workers`` applies it to the running cluster, also checking that
the resources are free now. ``current_node`` is what a worker reports as its node, and
``device_in_this_worker`` what its ``--device cuda:N`` means among the GPUs Ray gave it.

``python -m pdserve.placement --wait-nodes N`` waits for N alive nodes and prints each with its roles.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


class PlacementError(ValueError):
    """The cluster cannot hold the requested workers; the message names the missing resource."""


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node: its id, IP and total resources."""

    node_id: str
    ip: str
    resources: Mapping[str, float] = field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in ROLES if self.resources.get(r, 0) > 0)

    @property
    def label(self) -> str:
        return node_label(self.ip, self.node_id)


def node_label(ip: str, node_id: str) -> str:
    """How pdserve names a node: ``IP/first 8 hex digits of the Ray node id``."""
    return f"{ip}/{node_id[:8]}"


@dataclass(frozen=True)
class Placement:
    """Ray actor options per role; ``by_role`` False when no node offers a role (plain placement)."""

    by_role: bool
    demand: Mapping[str, Mapping[str, float]]  # role -> resources one worker takes
    counts: Mapping[str, int]  # role -> number of workers

    def actor_options(self, role: str) -> dict[str, Any]:
        """Options for ``ray.remote(cls).options(**...)``: CPUs, GPUs and custom resources of one worker."""
        need = dict(self.demand[role])
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": need.pop("GPU", 0)}
        if need:
            options["resources"] = need
        return options

    def total_demand(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for role, need in self.demand.items():
            for key, amount in need.items():
                total[key] = total.get(key, 0) + amount * self.counts[role]
        return total


def plan_placement(
    nodes: Iterable[NodeInfo], num_prefill: int, num_decode: int, use_gpu: bool, gpus_per_worker: float = 1.0
) -> Placement:
    """Actor options for ``num_prefill`` prefill and ``num_decode`` decode (or colocated) workers, each
    taking ``gpus_per_worker`` GPUs when ``use_gpu`` (a fraction <= 1 or a whole number; see
    ``DeploymentConfig.gpus_per_worker``).

    Raises ``PlacementError`` when the nodes' total resources cannot hold them: roles are in use but no
    node offers a role these workers need, too few units of it, or too few GPUs on the nodes of that role
    (workers sharing a GPU count as Ray packs them: ``floor(1 / gpus_per_worker)`` on each GPU).
    Raises ``ValueError`` for a ``gpus_per_worker`` that is not > 0.
    """
    if use_gpu and not gpus_per_worker > 0:
        raise ValueError(f"gpus_per_worker must be > 0, got {gpus_per_worker!r}")
    nodes = list(nodes)
    counts = {PREFILL: num_prefill, DECODE: num_decode}
    by_role = any(node.roles for node in nodes)
    demand: dict[str, dict[str, float]] = {}
    for role in ROLES:
        need: dict[str, float] = {role: 1} if by_role else {}
        if use_gpu:
            need["GPU"] = gpus_per_worker
        demand[role] = need
    placement = Placement(by_role, demand, counts)
    if use_gpu and not by_role and num_prefill and num_decode:  # both kinds share the GPUs: say so in one message
        short = _gpu_shortfall(nodes, num_prefill + num_decode, gpus_per_worker)
        if short:
            raise PlacementError(
                f"cannot place {num_prefill + num_decode} workers ({num_prefill} prefill + {num_decode} decode, "
                f"each needs {gpus_per_worker:g} 'GPU'): {short}"
            )
    free = {node.node_id: dict(node.resources) for node in nodes}
    # Greedy fill, the role with fewer candidate nodes first: enough for these node shapes (a role per node).
    order = sorted(ROLES, key=lambda r: sum(1 for n in nodes if _fits(n.resources, free[n.node_id], demand[r]) > 0))
    for role in order:
        left = counts[role]
        for node in nodes:
            take = min(left, _fits(node.resources, free[node.node_id], demand[role]))
            for key, amount in demand[role].items():
                free[node.node_id][key] = free[node.node_id].get(key, 0) - amount * take
            left -= take
        if left > 0:
            raise PlacementError(_shortfall(nodes, role, counts[role], demand[role]))
    return placement


def _fits(total: Mapping[str, float], free: Mapping[str, float], need: Mapping[str, float]) -> int:
    """How many more workers needing ``need`` fit on a node of ``total`` resources with ``free`` left (a
    large number when ``need`` is empty). A fraction of a GPU is a slot on one GPU: Ray places an actor
    on a single GPU, so each of the node's GPUs holds ``floor(1 / fraction)`` of them (every GPU worker of
    a plan takes the same fraction)."""
    if not need:
        return 1 << 30
    fits = []
    for key, amount in need.items():
        if key == "GPU" and amount < 1:
            placed = round((total.get(key, 0) - free.get(key, 0)) / amount)
            fits.append(_gpu_slots(total.get(key, 0), amount) - placed)
        else:
            fits.append(math.floor(free.get(key, 0) / amount + 1e-9))
    return max(0, min(fits))


def _gpu_slots(gpus: float, fraction: float) -> int:
    """Workers of ``fraction`` (< 1) of a GPU that ``gpus`` GPUs hold."""
    return math.floor(gpus + 1e-9) * math.floor(1 / fraction + 1e-9)


def _shortfall(nodes: list[NodeInfo], role: str, count: int, need: Mapping[str, float]) -> str:
    what = f"cannot place {count} {role} worker{'s' if count != 1 else ''} (each needs {_fmt(need)})"
    role_nodes = [n for n in nodes if n.resources.get(role, 0) > 0] if role in need else nodes
    if role in need and not role_nodes:
        offered = ", ".join(f"{n.label}: {'+'.join(n.roles) or 'no role'}" for n in nodes) or "no nodes"
        return (
            f"{what}: no node offers the resource {role!r} ({offered}); start a node with "
            f"`ray start --resources='{{\"{role}\": N}}'` (cluster/*.yaml do)"
        )
    where = f"nodes offering {role!r}" if role in need else "the cluster's nodes"
    for key in need:
        if key == "GPU":
            short = _gpu_shortfall(role_nodes, count, need[key], where)
            if short:
                return f"{what}: {short}"
            continue
        have = sum(n.resources.get(key, 0) for n in role_nodes)
        if have + 1e-9 < count * need[key]:
            return f"{what}: {where} have {have:g} {key!r} in total, {count * need[key]:g} needed"
    nodes_text = ", ".join(n.label for n in role_nodes)
    return (
        f"{what}: too little left on any one of {nodes_text} (a worker's resources come from one node) "
        "once the other role's workers are placed"
    )


def _gpu_shortfall(nodes: list[NodeInfo], count: int, gpus: float, where: str = "the cluster's nodes") -> str:
    """Why ``nodes`` cannot hold ``count`` workers of ``gpus`` GPUs each, or "" when they can."""
    have = sum(n.resources.get("GPU", 0) for n in nodes)
    if have + 1e-9 < count * gpus:
        return f"{where} have {have:g} 'GPU' in total, {count * gpus:g} needed"
    if gpus < 1:
        slots = sum(_gpu_slots(n.resources.get("GPU", 0), gpus) for n in nodes)
        if slots < count:
            per_gpu = math.floor(1 / gpus + 1e-9)
            return (
                f"{where} hold {slots} such workers ({per_gpu} per GPU: Ray places a worker on one GPU), {count} needed"
            )
    return ""


def _fmt(need: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {key!r}" for key, amount in need.items()) or "nothing"


def check_free(
    placement: Placement, available: Callable[[], Mapping[str, float]], wait_s: float = 5.0, poll_s: float = 0.25
) -> None:
    """Raise ``PlacementError`` unless ``available()`` covers the workers' demand within ``wait_s``.

    The cluster may hold the resources for other actors (another deployment); Ray would then leave the
    new workers pending without a word. Resources freed a moment ago show up within the wait.
    """
    total = placement.total_demand()
    deadline = time.monotonic() + wait_s
    while True:
        free = available()
        short = {key: amount for key, amount in total.items() if free.get(key, 0) + 1e-9 < amount}
        if not short:
            return
        if time.monotonic() >= deadline:
            detail = ", ".join(
                f"{key!r}: {amount:g} needed, {free.get(key, 0):g} free" for key, amount in short.items()
            )
            raise PlacementError(f"the cluster's resources are held by other actors ({detail})")
        time.sleep(poll_s)


# ---- the running cluster ------------------------------------------------------------------------
def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes of the Ray cluster this process is connected to."""
    import ray

    return [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def place_workers(
    num_prefill: int, num_decode: int, use_gpu: bool, wait_s: float = 5.0, gpus_per_worker: float = 1.0
) -> Placement:
    """``plan_placement`` on the connected cluster's nodes, then ``check_free`` against what is free now
    (in total: free fractions of GPUs are not checked for how they pack)."""
    import ray

    placement = plan_placement(cluster_nodes(), num_prefill, num_decode, use_gpu, gpus_per_worker)
    check_free(placement, ray.available_resources, wait_s)
    return placement


def current_node() -> str:
    """The node this Ray worker process runs on, as ``node_label`` gives it (IP from the GCS's node table).

    ``""`` outside Ray.
    """
    import ray

    if not ray.is_initialized():
        return ""
    node_id = ray.get_runtime_context().get_node_id()
    ip = next((n.ip for n in cluster_nodes() if n.node_id == node_id), None) or ray.util.get_node_ip_address()
    return node_label(ip, node_id)


def worker_device(device: str, visible_devices: str | None, device_count: int) -> str:
    """The torch device a Ray worker uses for the configured ``device``.

    Ray gives a worker its GPUs by setting ``CUDA_VISIBLE_DEVICES`` (``visible_devices``: the GPU ids,
    comma-separated), and the worker's CUDA then numbers those from 0 (``device_count`` of them). So
    ``cuda:N`` names GPU N as Ray (and ``nvidia-smi``) numbers them: it becomes its index among the
    visible ones (``cuda:3`` with ``"3"`` visible is ``cuda:0``). ``visible_devices`` None (not set:
    outside Ray) leaves every device as it is, and so do ``cpu``, ``cuda`` and ``auto``.

    Raises ``ValueError`` when GPU N is not this worker's: under Ray a worker cannot choose its GPU.
    """
    if visible_devices is None or not device.startswith("cuda:"):
        return device
    gpu = device.removeprefix("cuda:")
    ids = [part.strip() for part in visible_devices.split(",") if part.strip()]
    if not ids:
        raise ValueError(
            f"device {device!r}: Ray gave this worker no GPU (CUDA_VISIBLE_DEVICES is empty); "
            "a worker takes GPUs when the engine's device is cuda"
        )
    if gpu not in ids:
        raise ValueError(
            f"device {device!r}: Ray gave this worker GPU {','.join(ids)}, not GPU {gpu}, and a worker under "
            f"Ray cannot choose its GPU: use --device cuda (each worker on the GPU Ray gives it), or let Ray see "
            f"only GPU {gpu} (CUDA_VISIBLE_DEVICES={gpu} where Ray starts)"
        )
    index = ids.index(gpu)
    if index >= device_count:
        raise ValueError(
            f"device {device!r}: GPU {gpu} is visible (CUDA_VISIBLE_DEVICES={visible_devices}) but CUDA "
            f"finds {device_count} device{'s' if device_count != 1 else ''} in this worker"
        )
    return f"cuda:{index}"


def device_in_this_worker(device: str) -> str:
    """``worker_device`` for this process: inside a Ray actor, with its ``CUDA_VISIBLE_DEVICES``;
    elsewhere (the offline ``LLM``, tests) ``device`` unchanged. Raises ``ValueError`` as it does."""
    if not device.startswith("cuda:"):
        return device
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return device
    import torch

    return worker_device(device, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())


def wait_for_nodes(count: int, timeout_s: float, poll_s: float = 1.0) -> list[NodeInfo]:
    """Block until ``count`` nodes are alive; ``TimeoutError`` naming those present after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = cluster_nodes()
        if len(nodes) >= count:
            return nodes
        if time.monotonic() >= deadline:
            present = ", ".join(n.label for n in nodes) or "none"
            raise TimeoutError(f"{len(nodes)} of {count} nodes alive after {timeout_s:g} s: {present}")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.placement", description="Show a cluster's nodes and roles."
    )
    parser.add_argument("--address", default="auto", help="Ray cluster to connect to")
    parser.add_argument("--wait-nodes", type=int, default=1, help="wait until this many nodes are alive")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for them")
    args = parser.parse_args(argv)
    import ray

    ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        nodes = wait_for_nodes(args.wait_nodes, args.timeout)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    for n in nodes:
        roles = "+".join(n.roles) or "-"
        print(f"node {n.label}  roles {roles}  CPU {n.resources.get('CPU', 0):g}  GPU {n.resources.get('GPU', 0):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
