"""The explorer: its settings and figures (against ``pdserve sim --demo``), its JSON endpoints on a real
``pdserve sim --serve``, and the page itself in headless Chromium (Debian's, driven by Playwright),
for the playground and for the live view of a real local deployment.

Screenshots of both views are written to ``docs/explorer/`` (the README shows them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from idle import assert_idle

from pdserve.explorer.live import BurstSpec
from pdserve.explorer.playground import PlaygroundSettings, SettingError, run_playground
from pdserve.router.metrics import RecentLatencies

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ("http://127.0.0.1:", "data:")  # everything the page loads comes from its server
SCREENSHOTS = ROOT / "docs" / "explorer"
CHROMIUM = os.environ.get("PDSERVE_CHROMIUM", "/usr/bin/chromium")
# What a sandboxed root without network needs (see README, Tests): no sandbox, no GPU, no calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def sim_demo(tmp_path: Path, settings: PlaygroundSettings) -> dict[str, Any]:
    """``pdserve sim`` with the command line the playground shows: its results.json's demo figures."""
    from pdserve.sim.cli import main

    out = tmp_path / "sim"
    assert main([*settings.sim_argv(), "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "results.json").read_text())["extra"]["demo"]


# ---- settings and figures (no server) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"chunk_size": 0}, "chunk_size", "between 16"),
        ({"chunk_size": "big"}, "chunk_size", "whole number"),
        ({"num_decodes": 2.5}, "num_decodes", "whole number"),
        ({"chunking": "yes"}, "chunking", "true or false"),
        ({"mode": "sideways"}, "mode", "colocated"),
        ({"hardware": "TPU"}, "hardware", "unknown profile"),
        ({"itl_target_ms": 0}, "itl_target_ms", "between 1"),
        ({"num_decodes": 128}, "num_decodes", "between 0 and 127"),
        ({"prompt_len": 32768, "chunk_size": 16}, "chunk_size", "at most 1024"),
        ({"prompt_len": 32768, "chunk_size": 32, "num_decodes": 127}, "chunk_size", "too long a run"),
        ({"colour": "red"}, "colour", "unknown setting"),
        ([1, 2], "body", "JSON object"),
    ],
)
def test_bad_settings_name_the_control(body: Any, field: str, words: str):
    with pytest.raises(SettingError, match=words) as e:
        PlaygroundSettings.parse(body)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"model": "bench", "prompt_len": 8192}, "prompt_len", "at most 8192 tokens"),
        ({"model": "Llama-3-70B", "tp": 1}, "tp", "does not fit"),
        ({"model": "Llama-3-70B", "tp": 2}, "num_decodes", "KV cache holds"),
    ],
)
def test_settings_the_profile_cannot_take(body: dict[str, Any], field: str, words: str):
    with pytest.raises(SettingError, match=words) as e:
        run_playground(PlaygroundSettings.parse(body))
    assert e.value.field == field


def test_playground_is_pdserve_sim_demo(tmp_path: Path):
    """Both runs of the playground are the figures ``pdserve sim --demo`` writes for its command line."""
    settings = PlaygroundSettings.parse({"prompt_len": 8192, "chunk_size": 512, "num_decodes": 16})
    result = run_playground(settings)
    assert result["command"] == "pdserve sim " + " ".join(settings.sim_argv())
    demo = sim_demo(tmp_path, settings)
    on, off = result["runs"]
    for run, expected in ((on, demo["main"]), (off, demo["main_chunking_off"])):
        for name, value in run["figures"].items():
            assert value == pytest.approx(expected[name], rel=1e-9), name
    assert on["chunked"] and not off["chunked"]
    assert on["figures"]["steps_in_window"] == 16  # 8192 / 512 chunks, one step each
    assert off["figures"]["worst_decode_stall_ms"] > 5 * on["figures"]["worst_decode_stall_ms"]
    (decode,) = on["instances"]
    window = [s for s in decode["steps"] if 0 <= s[0] < on["window_ms"][1] - 1e-6]
    assert len(window) == 16 and all(s[4] == 512 and s[5] == 16 for s in window)
    for _start, ms, prefill_ms, decode_ms, *_ in decode["steps"]:
        assert prefill_ms + decode_ms == pytest.approx(ms, abs=2e-3) and prefill_ms >= 0 and decode_ms >= 0


def test_playground_calls_the_simulators_library_api_not_its_command_line(monkeypatch):
    import pdserve.sim.cli as sim_cli

    def no_parser() -> None:
        pytest.fail("the playground built pdserve sim's command-line parser")

    monkeypatch.setattr(sim_cli, "build_parser", no_parser)
    result = run_playground(PlaygroundSettings(prompt_len=2048, chunk_size=512, num_decodes=4))
    assert [run["chunked"] for run in result["runs"]] == [True, False]


def test_playground_disaggregated_has_a_timeline_per_instance():
    result = run_playground(PlaygroundSettings.parse({"mode": "disaggregated", "prefill": 1, "decode": 2}))
    on, _ = result["runs"]
    assert [i["name"] for i in on["instances"]] == ["prefill-0", "decode-0", "decode-1"]
    assert [i["role"] for i in on["instances"]] == ["prefill", "decode", "decode"]
    prefill = on["instances"][0]["steps"]
    assert sum(s[4] for s in prefill if s[0] >= 0) == 8192  # the long prompt, on the prefill instance
    # its chunks never share a step with the streams: no decode step waits for them
    assert on["figures"]["worst_decode_stall_ms"] < 20 and on["figures"]["steps_over_target"] == 0


def test_recent_latencies_percentiles_per_mode():
    recent = RecentLatencies(window_s=60)
    for i in range(1, 101):
        recent.add("itl", "colocated", i / 1000)
    recent.add("ttft", "disaggregated", 0.25)
    p = recent.percentiles()
    assert p["colocated"]["itl"]["n"] == 100
    assert p["colocated"]["itl"]["p50"] == pytest.approx(50.5)
    assert p["colocated"]["itl"]["p99"] == pytest.approx(99.01)
    assert p["disaggregated"] == {"ttft": {"n": 1.0, "p50": 250.0, "p90": 250.0, "p99": 250.0}}
    recent.window_s = 0.0
    time.sleep(0.01)
    assert recent.percentiles() == {}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (BurstSpec(mode="sideways"), "mode"),
        (BurstSpec(streams=65), "streams"),
        (BurstSpec(long_prompt_tokens=4096), "long_prompt_tokens"),
        (BurstSpec(streams=0, long_prompts=0), "at least one"),
        (BurstSpec(long_prompt_delay_s=-1), "long_prompt_delay_s"),
    ],
)
def test_bad_bursts(spec: BurstSpec, words: str):
    with pytest.raises(ValueError, match=words):
        spec.check(max_model_len=4096)


# ---- the JSON endpoints of `pdserve sim --serve` -------------------------------------------------------


@contextlib.contextmanager
def sim_server() -> Iterator[str]:
    """``pdserve sim --serve`` on a free loopback port, as a user starts it; yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli.main", "sim", "--serve", "--serve-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # the first line names the URL (or the error)
        assert ready, "pdserve sim --serve printed nothing for 60 s"
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match, f"pdserve sim --serve said {line!r}"
        yield match.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with sim_server() as url:
        yield url


def call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sim_serve_endpoints(sim_url: str):
    status, page = call(sim_url)
    assert status == 200 and b"pdserve explorer" in page and b"http://" not in page.replace(b"http://www.w3", b"")
    status, options = call(sim_url + "explorer/api/options")
    assert status == 200 and options["live"] is False and "H100" in options["hardware"]
    status, result = call(sim_url + "explorer/api/playground", "POST", {"chunk_size": 256})
    assert status == 200 and result["runs"][0]["figures"]["steps_in_window"] == 32
    status, error = call(sim_url + "explorer/api/playground", "POST", {"chunk_size": 0})
    assert status == 400 and error["error"]["field"] == "chunk_size" and "between 16" in error["error"]["message"]
    status, error = call(sim_url + "explorer/api/live")
    assert status == 409 and "pdserve serve --explorer-port" in error["error"]["message"]
    status, error = call(sim_url + "explorer/api/burst", "POST", {})
    assert status == 409


# ---- the page, in a real browser ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not shutil.which(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: run scripts/setup.sh (it installs Debian's chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    page.on("request", lambda r: r.url.startswith(LOCAL) or errors.append(f"outside request: {r.url}"))
    yield page
    context.close()
    assert not errors, errors


def ready_seq(page, after: int = 0) -> int:
    """Wait for a drawn playground result newer than run ``after``; returns its run number."""
    page.wait_for_function(
        f"(() => {{ const s = document.querySelector('#playground');"
        f" return s.dataset.state === 'ready' && Number(s.dataset.seq) > {after}; }})()",
        timeout=30_000,
    )
    return int(page.get_attribute("#playground", "data-seq"))


def figure(page, name: str) -> float:
    return float(page.get_attribute(f"#fig-{name}", "data-value"))


def bars(page, run: str) -> int:
    return page.locator(f".run[data-run={run}] g.bar").count()


def test_playground_in_the_browser(page, sim_url: str, tmp_path: Path):
    page.goto(sim_url)
    seq = ready_seq(page)
    stall_1024, bars_1024 = figure(page, "stall"), bars(page, "main")

    page.locator("#chunk_size").fill("8")  # 2^8: chunk 256
    seq = ready_seq(page, seq)
    assert page.text_content("#chunk_size-out") == "256 tokens"
    assert figure(page, "stall") < stall_1024 and bars(page, "main") > bars_1024
    # the figures on the page are `pdserve sim --demo`'s for the command line the page shows
    shown = page.text_content("#pg-command")
    settings = PlaygroundSettings.parse({"chunk_size": 256})
    assert shown == "pdserve sim " + " ".join(settings.sim_argv())
    demo = sim_demo(tmp_path, settings)["main"]
    assert figure(page, "stall") == pytest.approx(demo["worst_decode_stall_ms"], rel=1e-9)
    assert figure(page, "ttft") == pytest.approx(demo["long_prompt_ttft_ms"], rel=1e-9)
    assert figure(page, "over") == demo["steps_over_target"]
    assert figure(page, "throughput") == pytest.approx(demo["decode_throughput_tok_s"], rel=1e-9)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#chunk_size").fill("10")
    seq = ready_seq(page, seq)
    page.screenshot(path=str(SCREENSHOTS / "playground.png"), full_page=True)

    chunked_stall = figure(page, "stall")
    page.check("#long32k")  # 32k prompt, chunking off: one step carries the whole prompt
    seq = ready_seq(page, seq)
    assert page.text_content("#prompt_len-out") == "32768 tokens"
    assert figure(page, "stall") > 10 * chunked_stall
    assert page.text_content("#fig-over") == "1 of 1"
    assert page.locator(".run[data-run=main]").get_attribute("data-chunked") == "false"
    assert page.locator(".run[data-run=other]").get_attribute("data-chunked") == "true"
    page.screenshot(path=str(SCREENSHOTS / "playground-32k.png"), full_page=True)
    page.uncheck("#long32k")
    seq = ready_seq(page, seq)
    assert figure(page, "stall") == pytest.approx(chunked_stall)

    # out of range: the server's message, and no figures left over from the last good run
    page.select_option("#model", "Llama-3-70B")
    page.wait_for_selector("#playground[data-state=error]")
    assert "does not fit on 1 x H100" in page.text_content("#pg-error")
    assert page.get_attribute("#fig-stall", "data-value") is None
    assert bars(page, "main") == 0
    page.select_option("#tp", "4")
    ready_seq(page, seq)
    assert page.is_hidden("#pg-error") and figure(page, "stall") > 0


# ---- the live view of a real deployment ------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment():
    import ray

    from pdserve.deployment import Deployment, DeploymentConfig
    from pdserve.engine import EngineConfig

    engine = EngineConfig(
        model="tiny", device="cpu", num_kv_blocks=600, max_num_batched_tokens=256, torch_threads=1, max_model_len=2048
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = DeploymentConfig(
        engine=engine, mode="auto", num_prefill_workers=1, num_decode_workers=1, transport="grpc", explorer_port=0
    )
    try:
        with Deployment(config) as d:
            yield d
    finally:
        ray.shutdown()


@pytest.mark.cluster
def test_live_endpoints(deployment):
    url = deployment.explorer_url
    status, options = call(url + "explorer/api/options")
    assert status == 200 and options["live"] is True and options["default_mode"] == "auto"
    status, error = call(url + "explorer/api/burst", "POST", {"long_prompt_tokens": 5000})
    assert status == 400 and error["error"]["field"] == "long_prompt_tokens"
    status, error = call(url + "explorer/api/burst", "POST", {"streams": 2, "color": "red"})
    assert status == 400 and error["error"]["field"] == "color"
    status, burst = call(url + "explorer/api/burst", "POST", {"streams": 2, "long_prompts": 1, "mode": "colocated"})
    assert status == 202 and burst["requests"] == 3 and burst["mode"] == "colocated"
    deadline = time.monotonic() + 60
    while True:
        status, live = call(url + "explorer/api/live")
        assert status == 200
        if live["bursts"][-1]["ended"]:
            break
        assert time.monotonic() < deadline, live["bursts"]
        time.sleep(0.2)
    assert live["bursts"][-1]["done"] == 3 and live["bursts"][-1]["failed"] == 0
    status, live = call(url + "explorer/api/live")
    (decode,) = [w for w in live["workers"] if w["role"] == "decode"]
    assert sum(s[4] for s in decode["steps"]) >= 2 * 32 + 1536  # every prompt prefilled here (colocated)
    assert live["latency"]["colocated"]["ttft"]["n"] >= 3
    assert_idle(deployment)


@pytest.mark.cluster
def test_live_view_in_the_browser(deployment, page):
    page.goto(deployment.explorer_url + "#live")
    page.wait_for_selector("#live[data-state=ready]")
    for mode in ("disaggregated", "colocated"):
        page.select_option("#burst-mode", mode)
        page.click("#burst-send")
        page.wait_for_function(
            "(() => { const s = document.querySelector('#burst-status');"
            " return s.dataset.state === 'done' && s.textContent.includes('[" + mode + "]'); })()",
            timeout=60_000,
        )
        assert ", 0 failed" in page.text_content("#burst-status")
        page.wait_for_selector(f"#latency tr[data-mode={mode}]")
    page.wait_for_timeout(1200)  # one more refresh: the last steps and percentiles
    workers = page.locator("div.worker")
    names = {workers.nth(i).get_attribute("data-worker") for i in range(workers.count())}
    assert names == {w.worker_id for w in deployment.workers}
    for name in names:  # every worker's timeline shows steps, drawn as bars
        assert page.locator(f"div.worker[data-worker='{name}'] g.bar").count() > 0, name
    prefill_bars = page.locator("div.worker[data-worker='prefill-0'] rect.step.prefill").count()
    assert prefill_bars > 0
    for mode in ("disaggregated", "colocated"):
        cells = page.locator(f"#latency tr[data-mode={mode}] td").all_text_contents()
        assert int(cells[1]) >= 10 and all(float(c) > 0 for c in cells[2:]), cells
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "live.png"), full_page=True)
    assert_idle(deployment)
