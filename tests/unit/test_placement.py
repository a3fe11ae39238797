"""Worker placement by node role: pure planning on node tables, then on a real local Ray instance."""

from __future__ import annotations

import time

import pytest
import ray

from pdserve.cli.main import STATUS_COLUMNS, format_status
from pdserve.deployment import DeploymentConfig
from pdserve.options import add_config_arguments, config_from_args
from pdserve.placement import (
    DECODE,
    PREFILL,
    NodeInfo,
    Placement,
    PlacementError,
    check_free,
    device_in_this_worker,
    node_label,
    plan_placement,
    worker_device,
)


def _node(n: int, **resources: float) -> NodeInfo:
    return NodeInfo(f"{n:02d}" * 14, f"10.0.0.{n}", {"CPU": 8, **resources})


HEAD = _node(1)  # the router's node: no role
PREFILL_NODE = _node(2, prefill=4)
DECODE_NODE = _node(3, decode=4)


def test_roles_send_each_worker_kind_to_its_nodes():
    p = plan_placement([HEAD, PREFILL_NODE, DECODE_NODE], num_prefill=2, num_decode=3, use_gpu=False)
    assert p.by_role
    assert p.actor_options(PREFILL) == {"num_cpus": 0, "num_gpus": 0, "resources": {"prefill": 1}}
    assert p.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 0, "resources": {"decode": 1}}
    assert p.total_demand() == {"prefill": 2, "decode": 3}


def test_colocated_workers_are_decode_workers():
    p = plan_placement([PREFILL_NODE, DECODE_NODE], num_prefill=0, num_decode=4, use_gpu=False)
    assert p.actor_options(DECODE)["resources"] == {"decode": 1}
    assert p.total_demand() == {"prefill": 0, "decode": 4}


def test_gpu_workers_take_one_gpu_each_on_their_role_nodes():
    nodes = [HEAD, _node(2, prefill=8, GPU=8), _node(3, decode=8, GPU=8), _node(4, decode=8, GPU=8)]
    p = plan_placement(nodes, num_prefill=8, num_decode=16, use_gpu=True)
    assert p.actor_options(PREFILL) == {"num_cpus": 0, "num_gpus": 1, "resources": {"prefill": 1}}
    assert p.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 1, "resources": {"decode": 1}}


def test_no_role_anywhere_falls_back_to_plain_placement():
    p = plan_placement([HEAD, _node(2)], num_prefill=3, num_decode=5, use_gpu=False)
    assert not p.by_role
    assert p.actor_options(PREFILL) == {"num_cpus": 0, "num_gpus": 0}
    assert p.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 0}
    gpu = plan_placement([_node(1, GPU=2), _node(2, GPU=2)], num_prefill=1, num_decode=3, use_gpu=True)
    assert gpu.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 1}


def test_a_role_no_node_offers_is_named():
    with pytest.raises(PlacementError, match=r"cannot place 1 prefill worker .*no node offers the resource 'prefill'"):
        plan_placement([HEAD, DECODE_NODE], num_prefill=1, num_decode=1, use_gpu=False)


def test_too_few_role_units_are_named():
    with pytest.raises(PlacementError, match=r"cannot place 5 decode workers.*4 'decode' in total, 5 needed"):
        plan_placement([PREFILL_NODE, DECODE_NODE], num_prefill=1, num_decode=5, use_gpu=False)


def test_too_few_gpus_on_the_role_nodes_are_named():
    nodes = [_node(2, prefill=4, GPU=1), _node(3, decode=4, GPU=4), _node(4, GPU=8)]
    with pytest.raises(PlacementError, match=r"prefill workers.*nodes offering 'prefill' have 1 'GPU' in total, 2"):
        plan_placement(nodes, num_prefill=2, num_decode=1, use_gpu=True)
    with pytest.raises(PlacementError, match=r"cannot place 3 decode workers.*the cluster's nodes have 2 'GPU'"):
        plan_placement([_node(1, GPU=1), _node(2, GPU=1)], num_prefill=0, num_decode=3, use_gpu=True)


def test_a_node_offering_both_roles_shares_its_gpus_between_them():
    both = _node(2, prefill=4, decode=4, GPU=4)
    plan_placement([both], num_prefill=2, num_decode=2, use_gpu=True)
    with pytest.raises(PlacementError, match="'GPU'"):
        plan_placement([both], num_prefill=2, num_decode=3, use_gpu=True)


def test_check_free_waits_briefly_then_names_what_is_held():
    p = Placement(True, {PREFILL: {"prefill": 1}, DECODE: {"decode": 1}}, {PREFILL: 1, DECODE: 2})
    answers = iter([{"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 2}])
    check_free(p, lambda: next(answers), wait_s=5.0, poll_s=0.01)  # freed on the second look
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"'decode': 2 needed, 1 free"):
        check_free(p, lambda: {"prefill": 1, "decode": 1}, wait_s=0.2, poll_s=0.01)
    assert time.monotonic() - start < 2


def test_workers_sharing_one_gpu_take_a_fraction_each():
    gpu = _node(1, GPU=1)
    config = DeploymentConfig(mode="auto", num_prefill_workers=1, num_decode_workers=3, gpus_per_worker=0.25)
    p = plan_placement([gpu], config.prefill_worker_count, config.num_decode_workers, True, config.gpus_per_worker)
    assert p.actor_options(PREFILL) == {"num_cpus": 0, "num_gpus": 0.25}
    assert p.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 0.25}
    assert p.total_demand() == {"GPU": 1.0}
    with pytest.raises(
        PlacementError, match=r"cannot place 5 decode workers .*0.25 'GPU'.*have 1 'GPU' in total, 1.25"
    ):
        plan_placement([gpu], 0, 5, True, 0.25)
    with pytest.raises(
        PlacementError,
        match=r"cannot place 5 workers \(1 prefill \+ 4 decode, each needs 0.25 'GPU'\): .* 1 'GPU' in total, 1.25",
    ):
        plan_placement([gpu], 1, 4, True, 0.25)
    # on CPU the GPU share is unused
    assert plan_placement([_node(1)], 1, 3, False, 0.25).actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 0}


def test_both_roles_share_one_gpu_on_a_node_offering_both():
    node = _node(2, prefill=1, decode=1, GPU=1)
    p = plan_placement([HEAD, node], num_prefill=1, num_decode=1, use_gpu=True, gpus_per_worker=0.5)
    assert p.actor_options(PREFILL) == {"num_cpus": 0, "num_gpus": 0.5, "resources": {"prefill": 1}}
    assert p.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 0.5, "resources": {"decode": 1}}
    with pytest.raises(PlacementError, match="'GPU'"):
        plan_placement([HEAD, node], num_prefill=1, num_decode=1, use_gpu=True, gpus_per_worker=0.75)


def test_fractions_of_a_gpu_are_counted_as_ray_packs_them():
    # 0.4 of a GPU: two per GPU (0.8), not five on two GPUs, though 5 x 0.4 = 2
    two_gpus = [_node(1, GPU=2)]
    assert plan_placement(two_gpus, 0, 4, True, 0.4).actor_options(DECODE)["num_gpus"] == 0.4
    with pytest.raises(PlacementError, match=r"cannot place 5 decode workers.*hold 4 such workers \(2 per GPU"):
        plan_placement(two_gpus, 0, 5, True, 0.4)
    with pytest.raises(PlacementError, match=r"cannot place 5 workers \(1 prefill \+ 4 decode.*hold 4 such workers"):
        plan_placement(two_gpus, 1, 4, True, 0.4)  # 5 x 0.4 = 2 GPUs, yet only 4 fit
    plan_placement(two_gpus, 1, 3, True, 0.4)
    # a third of a GPU: three per GPU, whatever the float's last digit
    assert plan_placement([_node(1, GPU=1)], 1, 2, True, 1 / 3).total_demand()["GPU"] == pytest.approx(1)


def test_a_worker_may_take_several_whole_gpus():
    p = plan_placement([_node(1, GPU=4)], 1, 1, True, 2)
    assert p.actor_options(DECODE) == {"num_cpus": 0, "num_gpus": 2}
    with pytest.raises(
        PlacementError, match=r"cannot place 3 workers \(1 prefill \+ 2 decode.*4 'GPU' in total, 6 needed"
    ):
        plan_placement([_node(1, GPU=4)], 1, 2, True, 2)
    with pytest.raises(
        PlacementError, match=r"cannot place 1 decode worker .*too little left on any one of 10.0.0.1/\w+, 10.0.0.2"
    ):
        plan_placement([_node(1, GPU=1), _node(2, GPU=1)], 0, 1, True, 2)  # two GPUs, but not on one node


@pytest.mark.parametrize(
    ("gpus", "match"),
    [
        (0, "must be > 0, got 0"),
        (-0.5, "must be > 0"),
        (float("nan"), "must be > 0"),
        (float("inf"), "must be > 0"),
        (True, "must be > 0"),
        (1.5, "at most 1 .*or a whole number of GPUs, got 1.5"),
        (0.00001, "at least 0.0001"),
    ],
)
def test_gpus_per_worker_must_be_a_share_of_one_gpu_or_whole_gpus(gpus: float, match: str):
    with pytest.raises(ValueError, match=match):
        DeploymentConfig(gpus_per_worker=gpus)
    with pytest.raises(ValueError, match="must be > 0"):
        plan_placement([_node(1, GPU=1)], 0, 1, True, 0)


def test_gpus_per_worker_option_reaches_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, DeploymentConfig, only=("gpus_per_worker", "mode"))
    assert config_from_args(DeploymentConfig, parser.parse_args([])).gpus_per_worker == 1.0
    config = config_from_args(DeploymentConfig, parser.parse_args(["--gpus-per-worker", "0.25", "--mode", "auto"]))
    assert (config.gpus_per_worker, config.mode) == (0.25, "auto")
    with pytest.raises(ValueError, match="at most 1"):
        config_from_args(DeploymentConfig, parser.parse_args(["--gpus-per-worker", "2.5"]))


def test_serve_and_bench_take_gpus_per_worker():
    from pdserve.bench.runner import build_parser as bench_parser
    from pdserve.bench.runner import deployment_config, engine_config
    from pdserve.cli.main import build_parser

    args = bench_parser().parse_args(["--gpus-per-worker", "0.5", "--prefill-workers", "1"])
    assert deployment_config("disaggregated", args, engine_config(args)).gpus_per_worker == 0.5
    serve = build_parser().parse_args(["serve", "--gpus-per-worker", "0.25"])
    assert config_from_args(DeploymentConfig, serve).gpus_per_worker == 0.25


@pytest.mark.parametrize(
    ("device", "visible", "count", "expected"),
    [
        ("cuda:3", "3", 1, "cuda:0"),  # Ray gave GPU 3: the worker's only device
        ("cuda:3", "2,3", 2, "cuda:1"),  # two GPUs: GPU 3 is the second
        ("cuda:3", " 1, 3 ", 2, "cuda:1"),
        ("cuda", "3", 1, "cuda"),
        ("auto", "3", 1, "auto"),
        ("cpu", "", 0, "cpu"),
        ("cuda:3", None, 8, "cuda:3"),  # outside Ray: what it says
    ],
)
def test_cuda_n_names_a_gpu_among_those_ray_gave_the_worker(device, visible, count, expected):
    assert worker_device(device, visible, count) == expected


@pytest.mark.parametrize(
    ("device", "visible", "count", "match"),
    [
        ("cuda:1", "3", 1, r"Ray gave this worker GPU 3, not GPU 1.*--device cuda.*CUDA_VISIBLE_DEVICES=1"),
        ("cuda:0", "2,3", 2, r"Ray gave this worker GPU 2,3, not GPU 0"),
        ("cuda:0", "", 0, "Ray gave this worker no GPU"),
        ("cuda:1", "0,1", 1, r"GPU 1 is visible \(CUDA_VISIBLE_DEVICES=0,1\) but CUDA finds 1 device in"),
        ("cuda:0", "0", 0, "CUDA finds 0 devices"),
    ],
)
def test_a_gpu_the_worker_was_not_given_is_refused(device, visible, count, match):
    with pytest.raises(ValueError, match=match):
        worker_device(device, visible, count)


def test_outside_ray_cuda_n_means_what_it_says(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert not ray.is_initialized()
    assert device_in_this_worker("cuda:2") == "cuda:2"


def test_node_label_and_roles():
    assert node_label("127.0.0.3", "abcdef0123456789") == "127.0.0.3/abcdef01"
    assert DECODE_NODE.roles == (DECODE,) and HEAD.roles == ()
    assert _node(5, prefill=1, decode=2).roles == (PREFILL, DECODE)


def test_status_table_has_a_row_per_worker():
    from pdserve.messages import WorkerStats

    def worker(wid, role, node, device, used, cached, free, running, waiting, steps):
        return WorkerStats(wid, role, used + cached + free, free, cached, used, running, waiting, 0, 0, steps, 0,
                           node=node, device=device)  # fmt: skip

    workers = [
        worker("prefill-0", "prefill", "127.0.0.2/aa", "cpu", 3, 1, 60, 0, 0, 9),
        worker("decode-0", "decode", "", "cuda:0", 12, 4, 48, 2, 1, 120),
    ]
    lines = format_status(workers).splitlines()
    assert lines[0].split() == ["worker", "role", "node", "device", "KV", "used", *STATUS_COLUMNS[5:]]
    assert lines[1].split() == ["decode-0", "decode", "-", "cuda:0", "12", "4", "48", "2", "1", "120"]
    assert lines[2].split() == ["prefill-0", "prefill", "127.0.0.2/aa", "cpu", "3", "1", "60", "0", "0", "9"]


# ---- on a local Ray instance whose one node offers the roles ----------------------------------------
