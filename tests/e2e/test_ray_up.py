"""`ray up` for real: the commands of docs/cluster.md on a two-node loopback cluster.

Runs the block under "Two nodes on one machine" in docs/cluster.md command for command (after its first two
lines, setup and venv activation, which CI has done): loopback SSH up, `ray up` of ``cluster/local.yaml``,
``cluster/start.sh`` on the head through ``ray exec``, requests from outside the cluster over gRPC,
``pdserve status``, then stop, ``ray down`` and loopback SSH down, always, even when a step fails. Asserts identical
greedy tokens in colocated and disaggregated modes, prefill and decode workers on different nodes (the head
offers ``prefill``, the worker ``decode``), that with ``--transport grpc --verify-kv`` the decode worker advertises
its own node's address for KV (127.0.0.3, not the head's or 127.0.0.1) and disaggregated requests across the
nodes give the same tokens, that asking for more prefill workers than the cluster offers fails
at once naming the resource, and that nothing is left behind: no process of the cluster, no file in the home
directory, ``~/.ssh`` and ``~/.bashrc`` as they were, no ``/tmp/ray/cluster-*`` or ``/tmp/ray-config-*`` of
the cluster, no ``/tmp/ray/ray_current_cluster`` that a later ``ray.init()`` would join. Bounded: past
``BUDGET_S`` the running step is killed and the cleanup runs.

On a shared machine run it alone: ``ray down`` stops every Ray process on the machine
(``flock -x /tmp/pdserve-ray.lock python -m pytest -m ray_up``).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine import SamplingParams
from pdserve.router.client import Client

ROOT = Path(__file__).resolve().parents[2]
HOME = Path.home()
HEAD, WORKER = "127.0.0.2", "127.0.0.3"
TARGET = f"{HEAD}:50061"
BUDGET_S = 420.0  # for the commands up to the requests; the cleanup gets CLEANUP_S more
CLEANUP_S = 90.0
CLUSTER = "pdserve-local"

SETUP = ["bash scripts/setup.sh", ". .venv/bin/activate"]  # done by CI before pytest
UP = [
    "bash cluster/loopback_ssh.sh up",
    "ray get-auth-token --generate >/dev/null",
    "RAY_UP_enable_autoscaler_v2=0 ray up -y cluster/local.yaml",
    "ray exec cluster/local.yaml 'bash ~/pdserve/cluster/start.sh --wait-nodes 2 --mode auto "
    f"--prefill-workers 1 --decode-workers 1 --host {HEAD} --port 50061'",
]
USE = [
    f'pdserve generate "Hello" --target {TARGET} --mode colocated --max-tokens 8',
    f'pdserve generate "Hello" --target {TARGET} --mode disaggregated --max-tokens 8',
    f"pdserve status --target {TARGET}",
]
DOWN = [
    "ray exec cluster/local.yaml 'bash ~/pdserve/cluster/stop.sh'",
    "ray down -y cluster/local.yaml",
    "bash cluster/loopback_ssh.sh down",
]
DOC_COMMANDS = [*SETUP, *UP, *USE, *DOWN]
# Not in docs/cluster.md: serve again with the gRPC KV transport and checksums, then ask the decode worker
# where it receives KV (tests/support/ray_up_kv_probe.py, on the head, through Ray).
GRPC_START = (
    "ray exec cluster/local.yaml 'bash ~/pdserve/cluster/start.sh --mode auto --prefill-workers 1 "
    f"--decode-workers 1 --host {HEAD} --port 50061 --transport grpc --verify-kv'"
)
KV_PROBE = "ray exec cluster/local.yaml 'cd ~/pdserve && .venv/bin/python tests/support/ray_up_kv_probe.py decode-0'"


CLUSTER_DOC = ROOT / "docs" / "cluster.md"
DOC_HEADING = "## Two nodes on one machine"


def cluster_doc_block() -> list[str]:
    """The commands of the first ```bash block under DOC_HEADING in docs/cluster.md."""
    text = CLUSTER_DOC.read_text()
    section = text.split(DOC_HEADING, 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].rstrip() for line in block.splitlines() if line.strip()]


class Runner:
    """Runs shell commands at the repository root, each killed (its whole session) at a deadline."""

    def __init__(self, log: Path) -> None:
        self.log = log
        venv_bin = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_UP_enable_autoscaler_v2")}
        self.env["PATH"] = venv_bin + os.pathsep + self.env.get("PATH", "")
        self.times: list[tuple[str, float]] = []
        self.returncode: int | None = None

    def __call__(self, command: str, deadline: float, check: bool = True) -> str:
        timeout = max(1.0, deadline - time.monotonic())
        start = time.monotonic()
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            self._record(command, out, start, "timed out")
            raise AssertionError(f"timed out after {timeout:.0f} s: {command}\n{out[-3000:]}") from None
        self.returncode = proc.returncode
        self._record(command, out, start, f"rc={proc.returncode}")
        if check and proc.returncode != 0:
            raise AssertionError(f"rc={proc.returncode}: {command}\n{out[-3000:]}")
        return out

    def _record(self, command: str, out: str, start: float, result: str) -> None:
        took = time.monotonic() - start
        self.times.append((command, took))
        with self.log.open("a") as f:
            f.write(f"$ {command}\n{out}\n[{result}, {took:.1f} s]\n\n")


def cluster_processes() -> list[int]:
    """Processes of the loopback cluster: anything started in its SSH sessions (sshd marks their environment),
    the private sshd, and the launcher's SSH multiplexers for this cluster."""
    user_hash = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    control = f"/tmp/ray_ssh_{user_hash}/{hashlib.sha256(CLUSTER.encode()).hexdigest()[:10]}"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if b"PDSERVE_LOOPBACK_NODE=1" in environ or "pdserve-loopback-ssh" in cmdline or control in cmdline:
            found.append(int(proc.name))
    return found


def leftovers_snapshot() -> dict[str, object]:
    """What the test must leave as it found it."""

    def read(path: Path) -> bytes | None:
        return path.read_bytes() if path.is_file() else None

    tmp_ray = Path("/tmp/ray")
    return {
        "home": sorted(p.name for p in HOME.iterdir()),
        "~/.ssh": sorted(p.name for p in (HOME / ".ssh").iterdir()) if (HOME / ".ssh").is_dir() else None,
        "~/.ssh/config": read(HOME / ".ssh" / "config"),
        "~/.bashrc": read(HOME / ".bashrc"),
        "~/.ray": sorted(p.name for p in (HOME / ".ray").iterdir()) if (HOME / ".ray").is_dir() else None,
        "/tmp/ray/cluster-*": sorted(p.name for p in tmp_ray.glob("cluster-*")) if tmp_ray.is_dir() else [],
        "/tmp/ray-config-*": sorted(p.name for p in Path("/tmp").glob("ray-config-*")),
        "/tmp/ray_ssh_*": sorted(str(p) for p in Path("/tmp").glob("ray_ssh_*/*")),
        "loopback state": Path("/tmp/pdserve-loopback-ssh").exists(),
    }


def current_cluster_address() -> str | None:
    path = Path("/tmp/ray/ray_current_cluster")
    return path.read_text().strip() if path.is_file() else None


def test_cluster_doc_block_is_what_this_test_runs():
    assert cluster_doc_block() == DOC_COMMANDS


@pytest.mark.ray_up
@pytest.mark.timeout(600)  # BUDGET_S + CLEANUP_S + the snapshot checks
def test_ray_up_serves_both_modes_across_two_nodes(tmp_path):
    assert not cluster_processes(), "a loopback cluster is already running"
    before = leftovers_snapshot()
    address_before = current_cluster_address()
    run = Runner(tmp_path / "commands.log")
    started = time.monotonic()
    deadline = started + BUDGET_S
    failure: BaseException | None = None
    try:
        for command in UP[:-1]:
            run(command, deadline)
        # Not in docs/cluster.md: more prefill workers than the cluster offers fails at once, naming the resource.
        placement_started = time.monotonic()
        out = run(UP[-1].replace("--prefill-workers 1", "--prefill-workers 5"), deadline, check=False)
        assert run.returncode != 0 and "cannot place 5 prefill workers" in out and "'prefill'" in out, out[-2000:]
        assert time.monotonic() - placement_started < 90  # includes waiting for the worker node to join
        run(UP[-1], deadline)
        prompts = [[7, 19, 3, 88, 41] * 4, list(range(40, 110)), [250, 1, 2, 3] * 9]
        greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        tokens: dict[str, list[list[int]]] = {}
        metadata: dict[str, list[dict]] = {}
        with Client(TARGET, timeout_s=60) as client:
            for mode in ("colocated", "disaggregated"):
                chunks = [list(client.generate(p, greedy, mode=mode)) for p in prompts]
                tokens[mode] = [[t for c in cs for t in c.token_ids] for cs in chunks]
                metadata[mode] = [cs[-1].metadata for cs in chunks]
            stats = {w.worker_id: w for w in client.stats()}
        assert all(len(t) == 10 for t in tokens["colocated"]), tokens
        assert tokens["disaggregated"] == tokens["colocated"]
        assert {m.mode for m in metadata["disaggregated"]} == {"disaggregated"}
        assert all(m.prefill_worker == "prefill-0" for m in metadata["disaggregated"]), metadata
        assert all(m.kv_transfer_bytes > 0 for m in metadata["disaggregated"]), metadata
        prefill, decode = stats["prefill-0"], stats["decode-0"]
        assert prefill.node.startswith(f"{HEAD}/") and decode.node.startswith(f"{WORKER}/"), stats
        assert prefill.node != decode.node
        assert prefill.num_steps > 0 and decode.num_steps > 0

        outputs = [run(command, deadline) for command in USE]
        assert "mode" in outputs[0] and "colocated" in outputs[0], outputs[0]
        assert "disaggregated" in outputs[1], outputs[1]
        rows = {line.split()[0]: line.split() for line in outputs[2].splitlines()[1:] if line.strip()}
        assert rows["prefill-0"][1:3] == ["prefill", prefill.node], outputs[2]
        assert rows["decode-0"][1:3] == ["decode", decode.node], outputs[2]

        run(DOWN[0], deadline)  # stop.sh
        run(GRPC_START, deadline)
        probe = run(KV_PROBE, deadline)
        found = json.loads(probe.split("KV-PROBE ", 1)[1].splitlines()[0])
        kv = found["workers"]["decode-0"]
        [decode_node_id] = [n for n in found["nodes"] if kv["node"] == f"{found['nodes'][n]}/{n[:8]}"]
        kv_host, _, kv_port = kv["address"].rpartition(":")
        assert kv["kind"] == "grpc" and kv_port.isdigit(), kv
        assert kv_host == found["nodes"][decode_node_id] == WORKER, (kv, found["nodes"])  # its node's, not 127.0.0.1
        with Client(TARGET, timeout_s=60) as client:
            chunks = [list(client.generate(p, greedy, mode="disaggregated")) for p in prompts]
            stats = {w.worker_id: w for w in client.stats()}
        assert [[t for c in cs for t in c.token_ids] for cs in chunks] == tokens["colocated"]
        assert all(cs[-1].metadata.mode == "disaggregated" for cs in chunks), [cs[-1].metadata for cs in chunks]
        assert all(cs[-1].metadata.kv_transfer_bytes > 0 for cs in chunks), [cs[-1].metadata for cs in chunks]
        assert stats["prefill-0"].node.startswith(f"{HEAD}/") and stats["decode-0"].node == kv["node"], stats
    except BaseException as e:
        failure = e
    finally:
        cleanup_deadline = max(deadline, time.monotonic()) + CLEANUP_S
        cleanup_errors = []
        for command in DOWN:
            try:
                run(command, cleanup_deadline, check=command.startswith("bash cluster/loopback_ssh.sh"))
            except AssertionError as e:
                cleanup_errors.append(str(e))
        stragglers = wait_gone(cluster_processes, 20.0)
        for pid in stragglers:  # ours by construction (see cluster_processes): do not leave them running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    timings = "\n".join(f"  {took:6.1f} s  {command}" for command, took in run.times)
    print(f"ray up test: {time.monotonic() - started:.0f} s in all; log {run.log}\n{timings}")
    if failure is not None:
        raise AssertionError(f"{failure}\n(commands and output: {run.log})") from failure
    assert not cleanup_errors, cleanup_errors
    assert not stragglers, f"cluster processes left running (killed now): {stragglers}"
    assert leftovers_snapshot() == before
    address_after = current_cluster_address()
    assert address_after in (None, address_before) and address_after != f"{HEAD}:6379", address_after


def wait_gone(find, timeout_s: float) -> list[int]:
    """``find()`` until it returns nothing or ``timeout_s`` passes; the last answer."""
    deadline = time.monotonic() + timeout_s
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found
