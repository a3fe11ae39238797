"""benchmarks/peer_bench.py without the llama.cpp build: its arguments, the equal-KV arithmetic, the servers'
commands, the memory and stopping of a real process tree, the result table, and the HTTP client's token
counting on llama.cpp's stream."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import textwrap
import time

import peer_bench
import psutil
import pytest
from peer_bench import (
    Floor,
    KVPlan,
    ServerRun,
    kv_plan,
    llama_server_command,
    memory_lines,
    parse_args,
    pdserve_command,
    process_label,
    ratios,
    results_table,
    stop_tree,
    target_lines,
    tree_memory,
)

from pdserve.bench.runner import _read_events


def test_arguments_defaults_and_passthrough():
    args = parse_args(["--pdserve-args", "--quantization native --kv-cache-dtype bfloat16", "--json", "x.json"])
    assert args.repeat == 2 and args.threads == 2 and args.tokens == 128 and args.prefill_tokens == 1000
    assert args.streams == [16, 64]
    assert args.pdserve_args == ["--quantization", "native", "--kv-cache-dtype", "bfloat16"]
    assert peer_bench.engine_overrides(args.pdserve_args) == {"quantization": "native", "kv_cache_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--streams", "16,x"], "--streams"),
        (["--pdserve-args", "--num-kv-blocks 10"], "--num-kv-blocks is set by the benchmark"),
        (["--pdserve-args=--torch-threads=4"], "--torch-threads is set by the benchmark"),
        (["--llama-args", "-c 4096"], "-c is set by the benchmark"),
        (["--pdserve-args", "--block-size 32"], "give the block size as --block-size"),
        (["--pdserve-args", "'unclosed"], "--pdserve-args"),
        (["--tokens", "1"], "--tokens must be >= 2"),
        (["--omp-spin-count", "-1"], "--omp-spin-count must be >= 0"),
        (["--pdserve-args", "--omp-spin-count 0"], "--omp-spin-count is set by the benchmark"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_plan_gives_both_servers_the_same_tokens():
    plan = kv_plan(64, 1000 + 8, 16)
    assert (plan.slot_tokens, plan.total_tokens, plan.num_kv_blocks) == (1024, 65536, 4096)
    odd = kv_plan(16, 1100, 48)  # a slot is a multiple of llama.cpp's 256 and of the block size
    assert odd.slot_tokens == 1536 and odd.slot_tokens >= 1100
    assert odd.num_kv_blocks * odd.block_size == odd.total_tokens == 16 * 1536
    with pytest.raises(ValueError, match="must be >= 1"):
        kv_plan(0, 100, 16)


def test_commands_set_threads_slots_and_kv_capacity():
    plan = KVPlan(slots=64, slot_tokens=1024, block_size=16)
    llama = llama_server_command("/bin/llama-server", "/m.gguf", "127.0.0.1", 8081, 2, plan, ["--foo"])
    joined = " ".join(llama)
    for part in ("-m /m.gguf", "-t 2", "-tb 2", "-np 64", "-c 65536", "--no-kv-unified", "--port 8081"):
        assert part in joined
    assert llama[-1] == "--foo"
    pd = pdserve_command("127.0.0.1", 50051, 8082, 2, plan, ["--quantization", "native"])
    joined = " ".join(pd)
    for part in ("serve", "--model smollm2", "--torch-threads 2", "--num-kv-blocks 4096", "--block-size 16",
                 "--mode colocated", "--http-port 8082", "--omp-spin-count 20000"):  # fmt: skip
        assert part in joined
    assert pd[-2:] == ["--quantization", "native"]


GRANDCHILD = "x = bytearray(64 * 2**20); x[::4096] = b'1' * len(x[::4096]); print('ready', flush=True); input()"


def test_tree_memory_sums_a_real_process_tree_and_stop_tree_ends_it():
    child_code = textwrap.dedent(f"""
        import subprocess, sys
        g = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                             text=True)
        g.stdout.readline()
        print(g.pid, flush=True)
        g.wait()
    """)
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())  # type: ignore[union-attr]
        memory = tree_memory(child.pid)
        own = psutil.Process(child.pid).memory_info().rss + psutil.Process(grandchild).memory_info().rss
        assert len(memory.processes) == 2
        assert [label for label, _ in memory.processes] == ["python", "python"]  # `python -c`
        assert memory.rss_bytes >= 64 * 2**20
        assert abs(memory.rss_bytes - own) < 8 * 2**20  # the two processes' RSS, summed
    finally:
        start = time.monotonic()
        stop_tree(child, grace_s=5)  # type: ignore[arg-type]
    assert child.poll() is not None
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - start < 30


def test_processes_are_labelled_by_what_they_run_and_listed_per_server():
    python = "/venv/bin/python"
    serve = [python, "-m", "pdserve.cli.main", "serve", "--model", "smollm2"]
    assert process_label("python", serve) == "pdserve serve"
    assert process_label("python3.11", [python, "-m", "pytest", "-q"]) == "pytest"
    assert process_label("python", [python, "/venv/ray/dashboard/dashboard.py", "--host=127.0.0.1"]) == "dashboard.py"
    assert process_label("python", [python, "-u", "/venv/ray/_private/log_monitor.py"]) == "log_monitor.py"
    assert process_label("python", [python, "-c", "pass"]) == "python"
    assert process_label("ray::DecodeWorker", ["ray::DecodeWorker"]) == "ray::DecodeWorker"
    assert process_label("gcs_server", ["/venv/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"]) == "gcs_server"

    first = ServerRun("pdserve", 1, rss_bytes=3.0e9, processes=[("ray::DecodeWorker", int(2.0e9))])
    last = ServerRun("pdserve", 2, rss_bytes=3.3e9, pss_bytes=3.0e9)
    last.processes = [("ray::DecodeWorker", int(2.4e9)), ("pdserve serve", int(0.14e9))]
    peer = ServerRun("llama.cpp", 1, rss_bytes=1.73e9, processes=[("llama-server", int(1.73e9))])
    assert memory_lines([first, peer, last]) == [
        "pdserve #2 memory: RSS 3.30 GB, PSS 3.00 GB; by process (GB): ray::DecodeWorker 2.40, pdserve serve 0.14",
        "llama.cpp #1 memory: RSS 1.73 GB; by process (GB): llama-server 1.73",
    ]


def _run(server: str, repeat: int, decode: float, ttft: float, s16: float, s64: float, rss_gb: float) -> ServerRun:
    return ServerRun(
        server, repeat, healthy_s=9.0 if server == "pdserve" else 0.5, decode_tok_s=decode, itl_ms=1000 / decode,
        ttft_s=ttft, streams_tok_s={16: s16, 64: s64}, rss_bytes=rss_gb * 1e9,
    )  # fmt: skip


def test_result_table_and_targets_from_given_numbers():
    runs = [
        _run("pdserve", 1, 18.0, 2.0, 86.0, 130.0, 2.8),
        _run("llama.cpp", 1, 137.0, 3.2, 103.0, 84.0, 0.78),
        _run("llama.cpp", 2, 135.0, 5.8, 101.0, 113.0, 0.80),
        _run("pdserve", 2, 17.9, 1.9, 85.0, 122.0, 2.83),
    ]
    floor = Floor(
        bandwidth=10e9, pdserve_weight_bytes=540_000_000, file_weight_bytes=85_000_000, offline_decode_tok_s=19
    )
    plan = KVPlan(64, 1024, 16)
    r = ratios(runs, floor, [16, 64])
    assert r["one_stream"] == pytest.approx([18 / 137, 17.9 / 135])
    assert r["prefill_speedup"] == pytest.approx([3.2 / 2.0, 5.8 / 1.9])
    assert r["step_over_floor"] == pytest.approx([(1000 / 18) / 54, (1000 / 17.9) / 54])
    table = results_table(runs, floor, plan, 128, 1000, [16, 64])
    lines = table.splitlines()
    assert lines[0].startswith("| measure | pdserve")
    one = next(line for line in lines if line.startswith("| one stream"))
    assert (
        "| 17.9 (17.9–18) (ITL 55.7 (55.6–55.9) ms) | 136 (135–137) (ITL 7.35 (7.3–7.41) ms) | **0.13×** |" in one
        and "≥ 0.7×: MISS" in one
    )
    assert "65,536 tokens" in table
    judged = dict(zip([t.key for t in peer_bench.targets([16, 64])], target_lines(runs, floor, [16, 64]), strict=True))
    assert judged["one_stream"].startswith("MISS  ") and "0.13×" in judged["one_stream"]
    assert judged["step_over_floor"].startswith("PASS")  # 55.7 ms over a 54 ms floor: 1.03x
    assert judged["prefill_speedup"].startswith("PASS")  # 1.6x and 3.05x: median 2.33x
    assert "2.33×" in judged["prefill_speedup"]
    assert judged["streams_16"].startswith("MISS")
    assert judged["streams_64"].startswith("MISS")  # 130/84 = 1.55, 122/113 = 1.08: median 1.31
    assert judged["rss"].startswith("MISS")


def test_a_failed_server_leaves_its_figures_out():
    runs = [_run("pdserve", 1, 18.0, 2.0, 86.0, 130.0, 2.8), ServerRun("llama.cpp", 1, failures=["exited"])]
    assert ratios(runs, None, [16, 64]) == {}
    assert all(line.startswith("n/a") for line in target_lines(runs, None, [16, 64]))
    assert "n/a" in results_table(runs, None, KVPlan(64, 1024, 16), 128, 1000, [16, 64])


class _Lines:
    def __init__(self, events: list[dict | str]) -> None:
        self.lines = [(f"data: {e if isinstance(e, str) else json.dumps(e)}\n").encode() for e in events]

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for line in self.lines:
            yield line
            yield b"\n"


def _llama_chunk(text: str, predicted: int, usage: dict | None = None) -> dict:
    chunk: dict = {
        "choices": [{"text": text, "index": 0, "finish_reason": None}],
        "timings": {"predicted_n": predicted},
    }
    if usage:
        chunk["usage"] = usage
    return chunk


def test_client_counts_llama_cpp_tokens_from_its_timings():
    # llama-server holds back a token that ends inside a UTF-8 character and sends it with the next one;
    # its last chunk carries no new token
    events: list[dict | str] = [
        _llama_chunk("Hel", 1),
        _llama_chunk("lo ", 2),
        _llama_chunk("é!", 4),
        _llama_chunk("", 4, usage={"completion_tokens": 4}),
        "[DONE]",
    ]
    times: list[float] = []
    error, num_output, _ = asyncio.run(_read_events(_Lines(events), times))
    assert error is None and num_output == 4
    assert len(times) == 4 and times[2] == times[3]


def test_client_still_counts_token_ids_and_plain_text_chunks():
    times: list[float] = []
    events: list[dict | str] = [
        {"choices": [{"text": "ab", "token_ids": [1, 2]}]},
        {"choices": [{"text": "c"}]},
        "[DONE]",
    ]
    error, num_output, _ = asyncio.run(_read_events(_Lines(events), times))
    assert error is None and num_output is None and len(times) == 3
    assert not math.isnan(times[0])


def test_vllm_peer_commands_settings_and_table_from_given_numbers(tmp_path):
    import vllm_peer

    args = parse_args(["--peer", "vllm", "--vllm-args=--enforce-eager"])
    assert args.servers == ["pdserve", "vllm"] and args.streams_prompt_tokens == 200
    assert args.vllm_args == ["--enforce-eager"]
    command = vllm_peer.vllm_command(tmp_path / "python", tmp_path / "model", "127.0.0.1", 8000, 64, 4096, "float32")
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "float32" and command[command.index("--max-num-seqs") + 1] == "64"
    env = vllm_peer.vllm_env({"PATH": "/bin"}, 2, 1.0)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert vllm_peer.kv_tokens(1.0, 23040) == 46592  # SmolLM2 in 16 bits: vLLM's own figure for 1 GiB
    assert vllm_peer.vllm_dtype("float16") == "float16" and vllm_peer.vllm_dtype() in ("bfloat16", "float32")

    def run(server: str, repeat: int, decode: float, ttft: float, first: float, s16: float, s64: float, pss: float):
        return ServerRun(
            server, repeat, decode_tok_s=decode, ttft_s=ttft, first_token_s=first, streams_tok_s={16: s16, 64: s64},
            pss_bytes=int(pss * 1e9), itl_median_ms={1: 1000 / decode, 16: 100.0, 64: 300.0}, healthy_s=10.0,
        )  # fmt: skip

    runs = [run("pdserve", 1, 48.0, 0.8, 0.05, 270.0, 360.0, 2.0), run("vllm", 1, 40.0, 0.8, 0.057, 261.0, 352.0, 3.4)]
    r = ratios(runs, None, [16, 64], "vllm")
    assert r["one_stream"] == pytest.approx([1.2]) and r["first_token"] == pytest.approx([0.057 / 0.05])
    assert r["pss"] == pytest.approx([2.0 / 3.4])
    judged = target_lines(runs, None, [16, 64], "vllm")
    assert [line.split()[0] for line in judged] == ["PASS"] * 6
    limits = peer_bench.Limits({"float32": 100.0, "bfloat16": 300.0}, 240e9, 20e9, {"pdserve": 150e6, "vllm": 270e6})
    table = peer_bench.vllm_table(runs, limits, 46592, 128, 32, 1000, 200, [16, 64])
    assert "| 1000-token prompt: TTFT | 0.8 s | 0.8 s | **1.00×** (vLLM / pdserve) | ≥ 1×: PASS |" in table
    assert "46,592 KV tokens" in table and "| 100% | 100% |" in table  # 240 GFLOP in 0.8 s of a 300 GFLOP/s peak
    assert "(150 MB)" in table and "| 36% (150 MB) | 54% (270 MB) |" in table  # 7.5 ms floor at 48 tok/s
    assert peer_bench.prefill_flops(peer_bench_model_config(), 1000) == pytest.approx(246987823104, rel=1e-6)


def peer_bench_model_config():
    from pdserve.engine.config import ModelConfig

    return ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64,
    )  # fmt: skip


def test_the_token_check_compares_a_texts_own_tokens_without_the_bos_and_eos_added_around_them():
    from types import SimpleNamespace

    import vllm_peer

    adds_both = SimpleNamespace(
        encode=lambda text: [1, *map(ord, text), 2], add_bos_token=True, bos_token_id=1, add_eos_token=True,
        eos_token_ids=(2,),
    )  # fmt: skip
    assert vllm_peer.content_ids(adds_both, "ab") == [97, 98]
    adds_none = SimpleNamespace(encode=lambda text: [1, *map(ord, text)], add_bos_token=False, eos_token_ids=())
    assert vllm_peer.content_ids(adds_none, "ab") == [1, 97, 98]  # a 1 that the text itself gives stays
