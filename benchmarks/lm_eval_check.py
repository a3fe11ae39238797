"""lm-evaluation-harness scores SmolLM2 through pdserve's OpenAI API exactly as it scores it in ``transformers``.

One multiple-choice task over a local file (``benchmarks/lm_eval/pdserve_mc.yaml``: 40 questions, 4 choices each)
is scored three times with the same weights and the same tokenizer:

- ``lm_eval --model hf``: ``transformers`` running a float32 copy of SmolLM2 that ``transformers``' own GGUF loader
  dequantised from the packaged file (``results/lm_eval/hf``, with the tokenizer ``pdserve tokenizer export``
  writes);
- ``lm_eval --model local-completions`` against ``pdserve serve --model smollm2 --quantization none --dtype
  float32`` in ``colocated`` and in ``disaggregated`` mode (one prefill and one decode worker): the harness sends
  each context + continuation as token ids with ``echo: true, logprobs: 1, max_tokens: 1`` and sums the
  continuation's prompt log-probabilities.

lm-evaluation-harness runs from a virtualenv of its own (it pins its own ``transformers``); nothing is downloaded:

    python -m venv /opt/lm-eval && /opt/lm-eval/bin/pip install torch==2.13.0 "lm-eval[api]==0.4.13"
    python benchmarks/lm_eval_check.py --lm-eval /opt/lm-eval/bin/lm_eval

It prints acc and acc_norm of the three runs with the largest difference between a choice's log-likelihood as
served and as ``transformers`` computes it, writes ``results/lm_eval/summary-none.json``, and exits 1 when a
served run's figures differ from the ``hf`` run's. ``--quantization auto`` serves the default weights instead.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TASK = "pdserve_mc"
TASK_DIR = ROOT / "benchmarks" / "lm_eval"
MODES = ("colocated", "disaggregated")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def build_hf_folder(out: Path) -> None:
    """A float32 ``transformers`` checkpoint of the packaged SmolLM2 GGUF file (dequantised by ``transformers``
    itself, which refuses to save a GGUF-loaded model: it is rebuilt from its config), with pdserve's tokenizer."""
    if (out / "config.json").exists():
        return
    import torch
    import transformers

    from pdserve.cli.tokenizer import export_tokenizer
    from pdserve.engine.config import checkpoint_preset_file

    gguf = Path(checkpoint_preset_file("smollm2"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    export_tokenizer("smollm2", str(out))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scores(NamedTuple):
    acc: float
    acc_norm: float
    loglikelihoods: list[list[float]]  # per question (in the task's order), per choice


def lm_eval(binary: str, model: str, model_args: str, out: Path) -> Scores:
    """Run the harness on the task; returns its figures and every choice's log-likelihood."""
    command = [
        binary,
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        str(TASK_DIR),
        "--batch_size",
        "1",
        "--device",
        "cpu",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, **OFFLINE})
    newest = max(glob.glob(str(out / "**" / "results_*.json"), recursive=True), key=os.path.getmtime)
    metrics = json.loads(Path(newest).read_text())["results"][TASK]
    samples = max(glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True), key=os.path.getmtime)
    docs = sorted((json.loads(line) for line in Path(samples).read_text().splitlines()), key=lambda d: d["doc_id"])
    loglikelihoods = [[float(r[0][0]) for r in doc["resps"]] for doc in docs]
    return Scores(metrics["acc,none"], metrics["acc_norm,none"], loglikelihoods)


def serve(mode: str, port: int, http_port: int, quantization: str) -> subprocess.Popen[str]:
    """``pdserve serve`` (with ``--quantization none``: float32 weights, the exact path), listening once this
    returns."""
    command = [sys.executable, "-m", "pdserve.cli.main", "serve", "--model", "smollm2", "--quantization",
               quantization, "--mode", mode, "--port", str(port), "--http-port", str(http_port)]  # fmt: skip
    if quantization == "none":
        command += ["--dtype", "float32"]
    if mode != "colocated":
        command += ["--prefill-workers", "1"]
    print("$", " ".join(command[2:]), flush=True)
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    assert server.stdout is not None
    for line in server.stdout:
        if "OpenAI-compatible API on" in line:
            return server
        if time.monotonic() > deadline:
            break
    stop(server)
    raise SystemExit(f"pdserve serve --mode {mode} did not start")


def stop(server: subprocess.Popen[str]) -> None:
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command of lm-evaluation-harness's venv")
    parser.add_argument("--work", default=str(ROOT / "results" / "lm_eval"), help="checkpoint, outputs, summary")
    parser.add_argument(
        "--quantization",
        default="none",
        help="pdserve serve's (none: float32 weights, the exact path; auto: its default)",
    )
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    hf = work / "hf"
    build_hf_folder(hf)
    runs = {"hf": lm_eval(args.lm_eval, "hf", f"pretrained={hf},dtype=float32", work / "out-hf")}
    for mode in MODES:
        http_port = free_port()
        server = serve(mode, free_port(), http_port, args.quantization)
        try:
            model_args = (
                f"model=smollm2,base_url=http://127.0.0.1:{http_port}/v1/completions,tokenizer={hf},"
                "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
            )
            out = work / f"out-{mode}-{args.quantization}"
            runs[f"pdserve {mode}"] = lm_eval(args.lm_eval, "local-completions", model_args, out)
        finally:
            stop(server)
    print(f"\npdserve serve --quantization {args.quantization}")
    print(f"{'run':<24} {'acc':>8} {'acc_norm':>9} {'largest log-likelihood difference from hf':>42}")
    summary: dict[str, Any] = {"task": TASK, "quantization": args.quantization, "runs": {}}
    for name, scores in runs.items():
        diff = max(
            abs(a - b)
            for ours, theirs in zip(scores.loglikelihoods, runs["hf"].loglikelihoods, strict=True)
            for a, b in zip(ours, theirs, strict=True)
        )
        print(f"{name:<24} {scores.acc:>8.4f} {scores.acc_norm:>9.4f} {diff:>42.2e}")
        summary["runs"][name] = {"acc": scores.acc, "acc_norm": scores.acc_norm, "max_loglikelihood_diff": diff}
    (work / f"summary-{args.quantization}.json").write_text(json.dumps(summary, indent=1) + "\n")
    same = all(runs[f"pdserve {mode}"][:2] == runs["hf"][:2] for mode in MODES)
    print("the served runs score as transformers does" if same else "the served runs' figures DIFFER from hf's")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
