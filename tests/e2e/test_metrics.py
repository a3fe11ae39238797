"""Prometheus metrics: counted right after real traffic through both front doors, and their bookkeeping."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.messages import RequestMetrics, StepStats, WorkerStats
from pdserve.net import HttpServer
from pdserve.router.client import Client
from pdserve.router.http_api import metrics_app
from pdserve.router.metrics import RouterMetrics, is_kv_transfer_failure

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=300, max_num_batched_tokens=48, torch_threads=1, max_model_len=1024
)
PROMPT = "Metrics count what happened, no more and no less."

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples_of(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return samples_of(resp.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- the bookkeeping, without a deployment ----------------------------------------------------------------


def test_request_metrics_land_in_the_right_series():
    m = RouterMetrics("router-3")
    done = RequestMetrics(
        "a", "disaggregated", "decode-0", "prefill-0", ttft_s=0.2, e2e_s=1.2, num_prompt_tokens=7,
        num_output_tokens=11, kv_transfer_s=0.03, kv_transfer_bytes=4096, queue_s=0.01, prefill_s=0.1,
    )  # fmt: skip
    m.request_finished(done, "finished")
    fell_back = RequestMetrics(
        "b", "colocated", "decode-0", fallback="prefill worker failed: prefill worker prefill-0: KV push failed: x",
        num_output_tokens=1, ttft_s=0.5, e2e_s=0.5,
    )  # fmt: skip
    m.request_finished(fell_back, "finished")
    m.request_finished(RequestMetrics("c", "colocated", "decode-0", fallback="no prefill worker available"), "aborted")
    failed = RequestMetrics("d", "disaggregated", "decode-0", "prefill-0")
    m.request_finished(failed, "failed", "UNAVAILABLE", "decode worker decode-0: KV transfer deadline passed")
    m.request_rejected("RESOURCE_EXHAUSTED", "auto")
    m.token_gap(0.004, "disaggregated")
    m.token_gap(0.006, "disaggregated")

    from prometheus_client import generate_latest

    s = samples_of(generate_latest(m.registry).decode())
    assert value(s, "pdserve_requests_total", mode="disaggregated", outcome="finished") == 1
    assert value(s, "pdserve_requests_total", mode="colocated", outcome="finished") == 1
    assert value(s, "pdserve_requests_total", mode="colocated", outcome="aborted") == 1
    assert value(s, "pdserve_requests_total", mode="disaggregated", outcome="failed") == 1
    assert value(s, "pdserve_requests_total", mode="auto", outcome="rejected") == 1
    assert value(s, "pdserve_request_errors_total", code="UNAVAILABLE") == 1
    assert value(s, "pdserve_request_errors_total", code="RESOURCE_EXHAUSTED") == 1
    assert value(s, "pdserve_fallbacks_total", reason="prefill_failed") == 1
    assert value(s, "pdserve_fallbacks_total", reason="no_prefill_worker") == 1
    assert value(s, "pdserve_kv_transfer_failures_total") == 2  # the failed push and the missed deadline
    # latency histograms hold finished requests only; TPOT needs two tokens
    assert value(s, "pdserve_request_ttft_seconds_count", mode="disaggregated") == 1
    assert value(s, "pdserve_request_ttft_seconds_count", mode="colocated") == 1
    assert value(s, "pdserve_request_e2e_seconds_sum", mode="disaggregated") == pytest.approx(1.2)
    assert value(s, "pdserve_request_time_per_output_token_seconds_sum", mode="disaggregated") == pytest.approx(0.1)
    assert value(s, "pdserve_request_time_per_output_token_seconds_count", mode="colocated") == 0
    assert value(s, "pdserve_kv_transfer_seconds_count") == 1
    assert value(s, "pdserve_kv_transfer_bytes_sum") == 4096
    assert value(s, "pdserve_request_inter_token_latency_seconds_count", mode="disaggregated") == 2
    assert value(s, "pdserve_request_inter_token_latency_seconds_sum", mode="disaggregated") == pytest.approx(0.01)
    assert value(s, "pdserve_prompt_tokens_total", mode="disaggregated") == 7
    assert value(s, "pdserve_router_info", router="router-3") == 1
    assert not is_kv_transfer_failure("no prefill worker available")
    # every routed request counts by how it ended, and in the per-request token histograms
    assert value(s, "pdserve_requests_finished_total", reason="stop") == 2  # the default for "finished"
    assert value(s, "pdserve_requests_finished_total", reason="abort") == 1
    assert value(s, "pdserve_requests_finished_total", reason="error") == 1
    assert value(s, "pdserve_request_prompt_tokens_count", mode="disaggregated") == 2
    assert value(s, "pdserve_request_prompt_tokens_sum", mode="disaggregated") == 7
    assert value(s, "pdserve_request_generation_tokens_sum", mode="disaggregated") == 11
    assert value(s, "pdserve_request_generation_tokens_bucket", mode="disaggregated", le="10.0") == 1  # the failed 0


def test_finish_reasons_and_prefix_cache_counters():
    m = RouterMetrics()
    m.request_finished(RequestMetrics("a", "colocated", "d", num_prompt_tokens=100, num_cached_tokens=64), "finished",
                       reason="length")  # fmt: skip
    m.request_finished(RequestMetrics("b", "colocated", "d", num_prompt_tokens=50, num_cached_tokens=0), "finished",
                       reason="stop")  # fmt: skip
    m.request_finished(RequestMetrics("c", "colocated", "d", num_prompt_tokens=10), "aborted", reason="abort")
    from prometheus_client import generate_latest

    s = samples_of(generate_latest(m.registry).decode())
    assert value(s, "pdserve_requests_finished_total", reason="length") == 1
    assert value(s, "pdserve_requests_finished_total", reason="stop") == 1
    assert value(s, "pdserve_requests_finished_total", reason="abort") == 1
    assert value(s, "pdserve_prefix_cache_queries_total", mode="colocated") == 160
    assert value(s, "pdserve_prefix_cache_hits_total", mode="colocated") == 64


class StepsRouter:
    """Stands in for ``Router`` when scraped: one decode worker whose steps the test appends."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.active: dict[str, object] = {}
        self.num_queued = 0
        self.metrics = RouterMetrics()

    def run_steps(self, *durations_and_prefill: tuple[float, int]) -> None:
        for duration, prefill in durations_and_prefill:
            started = time.time() + len(self.steps) * 1e-3
            self.steps.append(StepStats(started, duration, num_prefill_tokens=prefill, num_decode_tokens=1))

    async def stats(self, steps_since: float | None = None) -> list[WorkerStats]:
        steps = tuple(s for s in self.steps if steps_since is None or s.started >= steps_since)
        return [WorkerStats("decode-0", "decode", 100, 60, 15, 25, 1, 0, 0, 0, len(self.steps), 0, steps=steps)]


def test_two_scrapers_see_the_same_cumulative_step_histograms():
    """Two clients scrape the metrics port in turns while steps run: each step counts once, in one histogram,
    and what one client reads does not depend on when the other scraped (the old averaged gauge did)."""
    router = StepsRouter()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = HttpServer(metrics_app(router), "127.0.0.1", 0)  # type: ignore[arg-type]
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    url = f"http://127.0.0.1:{server.port}/metrics"
    labels = {"worker": "decode-0", "role": "decode"}
    try:
        router.run_steps((0.5, 32), (0.01, 0), (0.02, 0))
        first_a = scrape(url)
        router.run_steps((0.03, 0), (0.25, 16))
        first_b = scrape(url)
        second_a = scrape(url)
        router.run_steps((0.04, 0))
        second_b = scrape(url)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert value(first_a, "pdserve_worker_decode_step_seconds_count", **labels) == 2
    assert value(first_a, "pdserve_worker_prefill_step_seconds_count", **labels) == 1
    assert value(first_a, "pdserve_worker_prefill_step_seconds_sum", **labels) == pytest.approx(0.5)
    assert first_b == second_a  # nothing ran between: a scrape changes nothing another client reads
    assert value(first_b, "pdserve_worker_decode_step_seconds_count", **labels) == 3
    assert value(first_b, "pdserve_worker_prefill_step_seconds_count", **labels) == 2
    assert value(second_b, "pdserve_worker_decode_step_seconds_count", **labels) == 4
    assert value(second_b, "pdserve_worker_decode_step_seconds_sum", **labels) == pytest.approx(0.1)
    # client B's rate over its own interval is the truth, however client A's scrape fell in it
    decode_between_b = value(second_b, "pdserve_worker_decode_step_seconds_sum", **labels) - value(
        first_b, "pdserve_worker_decode_step_seconds_sum", **labels
    )
    assert decode_between_b == pytest.approx(0.04)
    assert value(second_b, "pdserve_worker_kv_usage_ratio", **labels) == pytest.approx(0.25)


def test_step_records_carry_their_cpu_time_over_grpc_and_older_records_read_as_not_recorded():
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.router.wire import worker_stats_from_proto, worker_stats_to_proto

    step = StepStats(10.0, 0.05, 0.001, 32, 4, 5, worker="decode-0", device_s=0.04, cpu_s=0.03)
    stats = WorkerStats("decode-0", "decode", 100, 90, 0, 10, 1, 0, 0, 36, 7, 0, steps=(step,))
    wire = pb.WorkerStats.FromString(worker_stats_to_proto(stats).SerializeToString())
    assert worker_stats_from_proto(wire).steps == (step,)
    older = pb.WorkerStats(worker_id="decode-0", steps=[pb.StepRecord(started=10.0, duration_s=0.05)])
    assert worker_stats_from_proto(pb.WorkerStats.FromString(older.SerializeToString())).steps[0].cpu_s == 0.0


# ---- a real deployment ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = DeploymentConfig(
        engine=ENGINE,
        mode="colocated",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport="grpc",
        verify_kv=True,
        http_port=0,
        metrics_port=0,
    )
    with Deployment(config) as d:
        yield d


def _http_completion(deployment: Deployment, **body) -> dict:
    data = json.dumps({"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "ignore_eos": True, **body}).encode()
    req = urllib.request.Request(
        deployment.http_url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.cluster
def test_scrape_after_traffic_counts_every_request(deployment):
    assert len(deployment.metrics_ports) == 1
    metrics_url = f"http://127.0.0.1:{deployment.metrics_ports[0]}/metrics"
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Client(deployment.address) as client:
        for _ in range(3):  # finished, colocated, over gRPC
            assert sum(len(c.token_ids) for c in client.generate(PROMPT, greedy, mode="colocated")) == 8
        with pytest.raises(grpc.RpcError) as err:  # rejected: a token outside the vocabulary
            list(client.generate([1, 2, 100000], greedy, mode="colocated"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream = client.generate(PROMPT, SamplingParams(max_tokens=900, ignore_eos=True), mode="colocated")
        for _ in range(2):
            next(stream)
        stream.close()  # aborted: the client went away
    disaggregated = [_http_completion(deployment, max_tokens=8, pdserve_mode="disaggregated") for _ in range(2)]
    text = _http_completion(deployment, max_tokens=40)["choices"][0]["text"]
    stop = next(text[k : k + 2] for k in range(3, len(text) - 2) if text.find(text[k : k + 2]) == k)
    ended = _http_completion(deployment, max_tokens=40, stop=stop)  # finished by a stop string
    assert ended["choices"][0]["finish_reason"] == "stop"

    deadline = time.monotonic() + 15
    while True:  # the aborted stream's cancel reaches the router asynchronously
        s = scrape(metrics_url)
        if value(s, "pdserve_requests_total", mode="colocated", outcome="aborted") >= 1:
            break
        assert time.monotonic() < deadline, "the aborted request was never counted"
        time.sleep(0.1)

    finished_colocated = 3 + 2  # gRPC greedy, and the two 40-token HTTP ones
    assert value(s, "pdserve_requests_total", mode="colocated", outcome="finished") == finished_colocated
    assert value(s, "pdserve_requests_total", mode="disaggregated", outcome="finished") == 2
    assert value(s, "pdserve_requests_total", mode="colocated", outcome="rejected") == 1
    assert value(s, "pdserve_requests_total", mode="colocated", outcome="aborted") == 1
    assert value(s, "pdserve_requests_total", mode="colocated", outcome="failed") == 0
    assert value(s, "pdserve_request_errors_total", code="INVALID_ARGUMENT") == 1
    for mode, n in (("colocated", finished_colocated), ("disaggregated", 2)):
        assert value(s, "pdserve_request_ttft_seconds_count", mode=mode) == n
        assert value(s, "pdserve_request_e2e_seconds_count", mode=mode) == n
        assert value(s, "pdserve_request_queue_seconds_count", mode=mode) == n
        assert value(s, "pdserve_request_time_per_output_token_seconds_count", mode=mode) == n
        assert value(s, "pdserve_request_e2e_seconds_sum", mode=mode) > value(
            s, "pdserve_request_ttft_seconds_sum", mode=mode
        )
    # one gap per streamed chunk after the first: at most output tokens - 1 per request
    itl = value(s, "pdserve_request_inter_token_latency_seconds_count", mode="disaggregated")
    assert 0 < itl <= 2 * 7
    assert value(s, "pdserve_kv_transfer_seconds_count") == 2
    assert value(s, "pdserve_kv_transfer_bytes_sum") == sum(
        r["pdserve_metrics"]["kv_transfer_bytes"] for r in disaggregated
    )
    assert value(s, "pdserve_kv_transfer_bytes_sum") > 0
    assert value(s, "pdserve_output_tokens_total", mode="disaggregated") == 16
    assert value(s, "pdserve_prompt_tokens_total", mode="disaggregated") == 2 * len(PROMPT.encode())
    assert value(s, "pdserve_fallbacks_total", reason="prefill_failed") == 0
    assert value(s, "pdserve_kv_transfer_failures_total") == 0

    for worker, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
        labels = {"worker": worker, "role": role}
        assert value(s, "pdserve_worker_up", **labels) == 1
        assert value(s, "pdserve_worker_kv_blocks_total", **labels) == 300
        used, cached, free = (value(s, f"pdserve_worker_kv_blocks_{k}", **labels) for k in ("used", "cached", "free"))
        assert used == 0 and cached + free == 300 and cached > 0  # idle, with the prompt's prefix cached
        assert value(s, "pdserve_worker_running_requests", **labels) == 0
        assert value(s, "pdserve_worker_waiting_requests", **labels) == 0
        assert value(s, "pdserve_worker_prefill_step_seconds_count", **labels) > 0
        assert value(s, "pdserve_worker_kv_usage_ratio", **labels) == 0
        assert ("pdserve_preemptions_total", tuple(sorted(labels.items()))) in s
    assert value(s, "pdserve_worker_decode_step_seconds_count", worker="decode-0", role="decode") > 0
    # how each routed request ended: ignore_eos, so by length, but for the stop string and the abort
    assert value(s, "pdserve_requests_finished_total", reason="length") == 3 + 2 + 1
    assert value(s, "pdserve_requests_finished_total", reason="stop") == 1
    assert value(s, "pdserve_requests_finished_total", reason="abort") == 1
    assert value(s, "pdserve_requests_finished_total", reason="error") == 0
    assert value(s, "pdserve_request_prompt_tokens_count", mode="colocated") == finished_colocated + 1
    assert value(s, "pdserve_request_generation_tokens_sum", mode="disaggregated") == 16
    for mode in ("colocated", "disaggregated"):
        queries = value(s, "pdserve_prefix_cache_queries_total", mode=mode)
        assert queries == value(s, "pdserve_prompt_tokens_total", mode=mode)
        assert 0 < value(s, "pdserve_prefix_cache_hits_total", mode=mode) < queries  # the same prompt, repeated
    assert value(s, "pdserve_router_active_requests") == 0
    assert value(s, "pdserve_router_info", router="router-0") == 1

    # the HTTP API's /metrics is the same router's registry
    on_http = scrape(deployment.http_url + "/metrics")
    for key, v in s.items():
        if key[0].startswith("pdserve_request"):
            assert on_http[key] == v, key
