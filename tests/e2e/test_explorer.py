"""The explorer: its settings and figures (against ``pdserve sim --demo``), its JSON endpoints on a real
``pdserve sim --serve``, and the page itself in headless Chromium (Debian's, driven by Playwright),
for the playground and for the live view of a real local deployment.

Screenshots of both views are written to ``results/explorer/``; ``bash scripts/screenshots.sh`` writes them
to ``docs/explorer/`` instead (the images the docs show).
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.checks import assert_no_leaks

from pdserve.explorer.live import BurstSpec
from pdserve.explorer.playground import (
    MAX_WORK,
    PlaygroundSettings,
    SettingError,
    estimated_work,
    run_chunk_sweep,
    run_playground,
)
from pdserve.router.metrics import RecentLatencies

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ("http://127.0.0.1:", "data:")  # everything the page loads comes from its server
SCREENSHOTS = Path(os.environ.get("PDSERVE_SCREENSHOTS") or ROOT / "results" / "explorer")
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
    from pdserve.cli.sim import main

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
        ({"prompt_len": 32768, "chunk_size": 32, "num_decodes": 127}, "chunk_size", "request-steps"),
        ({"prompt_len": 32768, "chunk_size": 32, "instances": 8}, "chunk_size", "run it yourself: pdserve sim --demo"),
        ({"colour": "red"}, "colour", "unknown setting"),
        ([1, 2], "body", "JSON object"),
    ],
)
def test_bad_settings_name_the_control(body: Any, field: str, words: str):
    with pytest.raises(SettingError, match=words) as e:
        PlaygroundSettings.parse(body)
    assert e.value.field == field


def test_the_work_limit_counts_instances():
    """The same 32k prompt in chunks of 32 (about 1.3 s on a 2-core VM for one instance) is refused on 8
    instances, where every instance steps through the window, and on 4 prefill + 4 decode instances."""
    one = {"prompt_len": 32768, "chunk_size": 32}
    assert estimated_work(PlaygroundSettings.parse(one)) <= MAX_WORK
    for more in ({"instances": 8}, {"mode": "disaggregated", "prefill": 4, "decode": 4}):
        settings = PlaygroundSettings(**{**asdict(PlaygroundSettings()), **one, **more})
        assert estimated_work(settings) > 3 * MAX_WORK
        with pytest.raises(SettingError, match="pdserve sim --demo"):
            settings.check()


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"model": "bench", "prompt_len": 8192}, "prompt_len", "at most 8192 tokens"),
        ({"model": "Llama-3-70B", "tp": 1}, "tp", "does not fit"),
        ({"model": "Llama-3-70B", "tp": 2, "prompt_len": 32768}, "num_decodes", "KV cache holds"),  # 41k tokens
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
    # what the page explains: each step's kind, its roofline split, the first token on the axis
    kinds = dict(zip((s[0] for s in decode["steps"]), decode["kinds"], strict=True))
    assert {kinds[s[0]] for s in window} == {"long"}
    assert {k for t, k in kinds.items() if t < 0} <= {"warmup", "decode"} and "warmup" in kinds.values()
    assert on["first_token_ms"] == on["figures"]["long_prompt_ttft_ms"] and on["p99_itl_ms"] <= on["window_ms"][1]
    for (compute_ms, memory_ms), kind in zip(decode["bound"], decode["kinds"], strict=True):
        assert (compute_ms > memory_ms) == (kind == "long") or kind == "warmup"
    assert result["assumptions"]["kind"] == "roofline" and result["assumptions"]["hardware"] == "H100"


def test_playground_calls_the_simulators_library_api_not_its_command_line(monkeypatch):
    import pdserve.cli.sim as sim_cli

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
        children = psutil.Process(proc.pid).children()  # the playground's worker process, once a run started it
        proc.terminate()
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"processes outlived the server: {alive}"
    finally:
        if proc.poll() is None:
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
    status, sweep = call(sim_url + "explorer/api/sweep", "POST", {"num_decodes": 8})
    assert status == 200 and [p["chunk_size"] for p in sweep["points"]] == [128, 256, 512, 1024, 2048, 4096, 8192]
    status, error = call(sim_url + "explorer/api/sweep", "POST", {"num_decodes": -1})
    assert status == 400 and error["error"]["field"] == "num_decodes"
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
    expected_400 = "the server responded with a status of 400"  # a refused setting: the page shows why
    page.on("console", lambda m: m.type == "error" and expected_400 not in m.text and errors.append(m.text))
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
def deployment(ray_cluster):
    from pdserve.deployment import Deployment, DeploymentConfig
    from pdserve.engine import EngineConfig

    engine = EngineConfig(
        model="tiny", device="cpu", num_kv_blocks=600, max_num_batched_tokens=256, torch_threads=1, max_model_len=2048
    )
    config = DeploymentConfig(
        engine=engine,
        mode="auto",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport="grpc",
        verify_kv=True,
        explorer_port=0,
    )
    with Deployment(config) as d:
        yield d


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
    # every prompt computed here (colocated): all but possibly each one's last token as prefill tokens (a last
    # chunk of one token is decode-shaped and counted as a decode), and the streams' 2 x 63 fed-back tokens
    prefill_tokens, decode_tokens = (sum(s[i] for s in decode["steps"]) for i in (4, 5))
    assert prefill_tokens >= 2 * 32 + 1536 - 3 and prefill_tokens + decode_tokens >= 2 * 32 + 1536 + 2 * 63
    assert live["latency"]["colocated"]["ttft"]["n"] >= 3
    assert_no_leaks(deployment)


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
    for name in names:  # the ITL target line and the y-axis values, as in the playground
        timeline = page.locator(f"div.worker[data-worker='{name}'] svg.timeline")
        assert timeline.locator("line.target").count() == 1 and timeline.locator("line.grid").count() >= 2, name
    for mode in ("disaggregated", "colocated"):
        cells = page.locator(f"#latency tr[data-mode={mode}] td").all_text_contents()
        assert int(cells[1]) >= 10 and all(float(c) > 0 for c in cells[2:]), cells
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "live.png"), full_page=True)

    # a burst the server refuses: its message stays through the once-a-second refresh, naming the label
    page.fill("#burst-long-tokens", "5000")
    page.click("#burst-send")
    page.wait_for_timeout(2500)
    refused = page.locator("[role=alert]:visible")
    assert refused.count() == 1 and refused.text_content().startswith("Long prompt tokens"), refused.all_text_contents()
    assert_no_leaks(deployment)


# ---- what a person sees: the four bugs first, then the teaching parts ----------------------------------------

PAGE_LABELS = (
    "Prompt length",
    "Chunk size",
    "Concurrent decodes",
    "ITL target",
    "Architecture",
    "Instances",
    "Prefill (P)",
    "Decode (D)",
    "Hardware",
    "Model",
    "Tensor parallel",
)
INTERNAL_KEYS = ("chunk_size", "num_decodes", "prompt_len", "itl_target_ms", "tp:", "instances:", "prefill:")


def displayed(page, selector: str) -> bool:
    """Whether the element takes space on the page (its computed style and its ancestors', not the attribute)."""
    script = "el => el.getClientRects().length > 0 && getComputedStyle(el).display !== 'none'"
    return page.eval_on_selector(selector, script)


def assert_names_a_label(message: str) -> None:
    assert message.startswith(PAGE_LABELS), message
    assert not any(key in message for key in INTERNAL_KEYS), message


def test_fields_of_the_other_architecture_are_hidden(page, sim_url: str):
    page.goto(sim_url)
    ready_seq(page)
    assert displayed(page, "#instances") and not displayed(page, "#prefill") and not displayed(page, "#decode")
    page.select_option("#mode", "disaggregated")
    ready_seq(page)
    assert not displayed(page, "#instances") and displayed(page, "#prefill") and displayed(page, "#decode")


def test_a_refused_setting_leaves_nothing_of_the_last_run(page, sim_url: str):
    page.goto(sim_url)
    seq = ready_seq(page)
    assert "ran in" in page.text_content("#pg-elapsed")
    page.select_option("#model", "Llama-3-70B")
    page.wait_for_selector("#playground[data-state=error]")
    assert page.text_content("#pg-command") == "" and page.text_content("#pg-elapsed") == ""
    assert_names_a_label(page.text_content("#pg-error"))
    page.select_option("#model", "Llama-3-8B")
    ready_seq(page, seq)


def test_an_empty_or_typed_over_number_names_its_label(page, sim_url: str):
    page.goto(sim_url)
    seq = ready_seq(page)
    page.fill("#instances", "")
    page.press("#instances", "Tab")  # the field's change event: what a person clearing it and moving on does
    page.wait_for_selector("#playground[data-state=error]")
    message = page.text_content("#pg-error")
    assert_names_a_label(message)
    assert message.startswith("Instances") and "got 0" not in message
    page.fill("#instances", "2")
    page.press("#instances", "Tab")
    seq = ready_seq(page, seq)
    page.click("#instances", click_count=3)
    page.keyboard.type("e")  # Chromium takes only number characters; "e" alone is not a number
    page.keyboard.press("Tab")
    page.wait_for_selector("#playground[data-state=error]")
    message = page.text_content("#pg-error")
    assert message.startswith("Instances") and "got 0" not in message, message


def test_caption_definitions_and_assumptions_say_what_the_run_shows(page, sim_url: str):
    page.goto(sim_url)
    seq = ready_seq(page)
    text = page.text_content("#pg-caption")
    stall, ttft = page.text_content("#fig-stall"), page.text_content("#fig-ttft")
    other_stall = figure_of(page, "#fig-stall-other")
    assert f"worst decode stall was {stall}" in text and f"came {ttft} after it arrived" in text, text
    assert "took 8 steps" in text and "24 streams" in text and "None of the 8 steps went over the 50 ms" in text
    assert f"one {other_stall:.0f} ms step freezes all 24 streams" in text
    assert f"{page.text_content('#fig-ratio')} this one" in text  # the stall ratio, as the figure shows it
    assert "smaller chunk" in text and "later" in text  # the trade-off
    for definition in page.locator(".figure .def").all_text_contents():
        assert len(definition.split()) >= 8, definition
    said = page.text_content("#assumptions")
    a = run_playground(PlaygroundSettings.parse({}))["assumptions"]  # the default run's cost model
    mfu, overhead = f"{100 * a['mfu']:.0f}% MFU", f"{a['step_overhead_ms']:.1f} ms a step"
    assert all(words in said for words in ("H100", "989 TFLOP/s", mfu, "3.35 TB/s", overhead, "compute-bound")), said
    assert displayed(page, "#lesson-note") and "toy cost model" in page.text_content("#lesson-note")

    page.locator("#chunk_size").fill("9")  # 512: the caption states what moved
    seq = ready_seq(page, seq)
    text = page.text_content("#pg-caption")
    assert "From chunk 1024 to 512" in text and "(lower)" in text and "(later)" in text, text
    assert not displayed(page, "#lesson-note")
    page.locator("#chunk_size").fill("11")
    seq = ready_seq(page, seq)
    assert "steps went over the 50 ms ITL target" in page.text_content("#pg-caption")  # 2048: 4 of 4

    h100 = figure(page, "stall")  # the prefill steps are compute-bound: more bandwidth, about the same stall
    page.select_option("#hardware", "H200")
    seq = ready_seq(page, seq)
    said = page.text_content("#assumptions")
    assert 0.9 * h100 < figure(page, "stall") < h100 and "H200" in said  # the soft knee: a little shorter
    assert "only a little" in said and "compute-bound (4 of 4)" in said, said


def figure_of(page, selector: str) -> float:
    return float(re.search(r"([\d.]+) ms", page.text_content(selector)).group(1))


def current_step(page) -> tuple[int, str]:
    assert page.locator("g.bar.current").count() == 1
    return int(page.get_attribute("#step-through", "data-step")), page.text_content("#step-detail")


def test_step_through_from_the_keyboard_and_by_touch(page, sim_url: str):
    page.goto(sim_url)
    ready_seq(page)
    first, detail = current_step(page)
    assert "Step 5 of 16" in detail and "chunk 1 of 8: tokens 1–1024" in detail and "24 streams waited" in detail
    page.keyboard.press("Tab")
    while page.evaluate("document.activeElement.id") != "step-through":  # reach it the way a keyboard user does
        page.keyboard.press("Tab")
    page.keyboard.press("ArrowRight")
    index, detail = current_step(page)
    assert index == first + 1 and "chunk 2 of 8: tokens 1025–2048" in detail
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    index, detail = current_step(page)
    assert index == first - 1 and "no prefill" in detail
    page.keyboard.press("Home")
    assert "warm-up" in current_step(page)[1]
    page.keyboard.press("End")
    assert current_step(page)[0] == 15
    page.keyboard.press("Home")
    page.keyboard.press(" ")  # play
    assert page.get_attribute("#step-play", "aria-pressed") == "true"
    page.wait_for_function("Number(document.querySelector('#step-through').dataset.step) >= 2", timeout=5000)
    page.keyboard.press(" ")
    assert page.get_attribute("#step-play", "aria-pressed") == "false"
    page.focus("#step-next")
    page.keyboard.press("Enter")
    stopped = current_step(page)[0]
    assert stopped >= 3
    # a tap on a bar of the other row picks that step: the detail needs no hovering
    page.locator(".run[data-run=other] g.bar.long .hit").first.click()
    index, detail = current_step(page)
    assert page.get_attribute("#step-through", "data-run") == "1" and "the whole long prompt (8192 tokens)" in detail


def test_timelines_mark_the_prompt_and_share_a_time_range(page, sim_url: str):
    page.goto(sim_url)
    ready_seq(page)
    timelines = page.locator("svg.timeline")
    assert timelines.count() == 2
    ranges = {(t.get_attribute("data-x0"), t.get_attribute("data-x1")) for t in timelines.all()}
    assert len(ranges) == 1  # both rows, one time range
    for t in timelines.all():
        labels = t.locator("text.mark-label").all_text_contents()
        assert labels == ["long prompt arrives", "its first token"]
        assert len(t.locator("line.grid").all()) >= 3 and t.locator("line.target").count() == 1  # y values, target
    fill = "el => getComputedStyle(el).fill"
    warmup = page.locator(".run[data-run=main] g.bar.warmup rect.prefill").first.evaluate(fill)
    long = page.locator(".run[data-run=main] g.bar.long rect.prefill").first.evaluate(fill)
    assert warmup != long  # the streams' own prompts are told apart from the long prompt
    page.check("#long32k")  # one 1.1 s bar: the 8 ms decode steps still show, on the log scale taller
    ready_seq(page)
    height = "el => el.getBoundingClientRect().height"
    decode_only = page.locator(".run[data-run=main] g.bar.decode rect.decode").last
    linear = decode_only.evaluate(height)
    assert linear >= 1.5
    page.select_option("#y-scale", "log")
    assert "logarithmic" in page.text_content("#scale-note")
    assert page.locator(".run[data-run=main] g.bar.decode rect.decode").last.evaluate(height) > 10 * linear


def test_the_chunk_size_sweep_marks_the_knee(page, sim_url: str):
    page.goto(sim_url)
    ready_seq(page)
    page.click("#sweep-run")
    page.wait_for_selector("#sweep[data-state=ready]", timeout=60_000)
    expected = run_chunk_sweep(PlaygroundSettings())
    rows = page.locator("#sweep-table tbody tr")
    assert rows.count() == 7
    knee = expected["knee_chunk_size"]
    assert knee == 1024 and page.get_attribute("#sweep-table tr.knee", "data-chunk") == str(knee)
    assert page.get_attribute("#sweep-chart g.point.knee", "data-chunk") == str(knee)
    assert f"chunk {knee}" in page.text_content("#sweep-status")
    for point, row in zip(expected["points"], rows.all(), strict=True):
        assert row.locator("td").nth(1).text_content() == f"{point['p99_itl_ms']:.1f}"
    page.locator("#itl_target_ms").fill("100")
    ready_seq(page)
    assert page.get_attribute("#sweep", "data-state") == "stale"


PHONE_CHECK = """() => {
  const small = [];
  for (const el of document.querySelectorAll('body *')) {
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || !el.getClientRects().length) continue;
    let size = parseFloat(getComputedStyle(el).fontSize);
    const svg = el.closest('svg');
    if (svg) size *= svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
    if (size < 11) small.push(`${el.tagName} ${size.toFixed(1)}px: ${el.textContent.trim().slice(0, 30)}`);
  }
  const wide = [...document.querySelectorAll('body *')]
    .filter((el) => el.getBoundingClientRect().right > innerWidth + 0.5 && !el.closest('.scroll'))
    .map((el) => el.tagName + '.' + el.className);
  return {scroll: document.documentElement.scrollWidth, width: innerWidth, small, wide};
}"""


def test_phone_layout_in_the_browser(browser, sim_url: str):
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True)
    page = context.new_page()
    try:
        page.goto(sim_url)
        seq = ready_seq(page)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "playground-phone.png"))
        page.locator("#pg-figure").screenshot(path=str(SCREENSHOTS / "playground-phone-timelines.png"))
        page.click("#sweep-run")
        page.wait_for_selector("#sweep[data-state=ready]", timeout=60_000)
        for mode in ("colocated", "disaggregated"):
            if mode != "colocated":
                page.select_option("#mode", mode)
                seq = ready_seq(page, seq)
            seen = page.evaluate(PHONE_CHECK)
            assert seen["scroll"] <= seen["width"] == 390, seen["wide"]
            assert not seen["wide"] and not seen["small"], seen
        # the timelines keep their size and scroll sideways inside their box
        box = page.locator(".run .scroll").first
        assert box.evaluate("el => el.scrollWidth > el.clientWidth && el.getBoundingClientRect().right <= 390")
        page.locator(".run[data-run=main] g.bar .hit").nth(3).tap()
        assert page.locator("g.bar.current").count() == 1 and page.text_content("#step-detail").startswith("Step 4")
    finally:
        context.close()


def test_walkthrough_in_the_browser(page, sim_url: str):
    """The docs' walk-through, as a learner does it: chunk 2048, then 512, a step of each, then the sweep.
    The page alone says why 512 stalls less and what it costs (and the screenshots show it)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.goto(sim_url)
    seq = ready_seq(page)
    seen = {}
    for index, chunk in ((11, 2048), (9, 512)):
        page.locator("#chunk_size").fill(str(index))
        seq = ready_seq(page, seq)
        page.focus("#step-through")
        page.keyboard.press("ArrowRight")  # the long prompt's second chunk
        detail = page.text_content("#step-detail")
        assert f"{chunk} tokens of the long prompt (chunk 2 of {8192 // chunk}" in detail and "compute-bound" in detail
        seen[chunk] = {name: figure(page, name) for name in ("stall", "ttft", "over")}
        seen[chunk]["caption"] = page.text_content("#pg-caption")
        seen[chunk]["detail"] = detail
        page.locator("#pg-result").screenshot(path=str(SCREENSHOTS / f"walkthrough-chunk-{chunk}.png"))
    assert seen[512]["stall"] < seen[2048]["stall"] / 3 and seen[512]["ttft"] > seen[2048]["ttft"]
    assert seen[2048]["over"] == 4 and seen[512]["over"] == 0
    assert "over the 50 ms ITL target" in seen[2048]["detail"] and "within the 50 ms" in seen[512]["detail"]
    assert "From chunk 2048 to 512" in seen[512]["caption"] and "(lower)" in seen[512]["caption"]
    page.click("#sweep-run")
    page.wait_for_selector("#sweep[data-state=ready]", timeout=60_000)
    page.locator("#sweep").screenshot(path=str(SCREENSHOTS / "sweep.png"))


def test_every_refusal_names_a_label_on_the_page(page, sim_url: str):
    """The server's refusals, reached through the page's own controls: each message starts with the label
    of the control to change, never an internal key."""
    page.goto(sim_url)
    seq = ready_seq(page)

    def refused(change: Any, starts: str, *words: str) -> None:
        shown = int(page.get_attribute("#playground", "data-errors") or 0)
        change()
        page.wait_for_function(f"Number(document.querySelector('#playground').dataset.errors || 0) > {shown}")
        message = page.text_content("#pg-error")
        assert_names_a_label(message)
        assert message.startswith(starts) and all(w in message for w in words), message

    def eight_instances() -> None:
        page.fill("#instances", "8")
        page.press("#instances", "Tab")

    refused(lambda: page.select_option("#model", "Llama-3-70B"), "Tensor parallel", "does not fit")
    refused(lambda: page.check("#long32k"), "Tensor parallel", "does not fit")  # a 32k prompt ...
    refused(lambda: page.select_option("#tp", "2"), "Concurrent decodes", "KV cache holds")  # ... over 41k tokens
    refused(lambda: page.select_option("#model", "bench"), "Prompt length", "at most 8192 tokens")
    page.select_option("#model", "Llama-3-8B")
    page.select_option("#tp", "1")
    seq = ready_seq(page, seq)
    page.check("#long32k")
    page.locator("#chunk_size").fill("5")  # 32k in chunks of 32 ...
    seq = ready_seq(page, seq)
    command = "--decode-workers 8 --demo-prompt-len 32768 --demo-chunk 32 "  # ... on 8 instances: past the work limit
    refused(eight_instances, "Chunk size", "fewer instances", "pdserve sim --demo", command)
    page.fill("#instances", "1")
    page.press("#instances", "Tab")
    ready_seq(page, seq)
