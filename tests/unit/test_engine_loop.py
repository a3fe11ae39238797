"""The engine loop thread: commands run between steps, errors reach the caller, nothing hangs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.engine_loop import EngineLoop, build_in_passing_thread


@pytest.fixture
def engine():
    return LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, max_model_len=512))


def test_commands_and_step_callbacks(engine):
    finished = threading.Event()
    tokens: list[int] = []

    def on_step(e, outputs):
        for out in outputs:
            tokens.extend(out.new_token_ids)
            if out.finished:
                finished.set()

    loop = EngineLoop(engine, on_step=on_step)
    try:
        rid = loop.call(
            lambda e: e.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        ).result(10)
        assert finished.wait(30)
        assert len(tokens) == 5 and rid.startswith("req-")
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            loop.call(lambda e: e.add_request([])).result(10)
        assert loop.alive  # a failing command does not kill the loop
        loop.call(lambda e: e.block_manager.check_integrity()).result(10)
    finally:
        loop.stop()
    assert not loop.alive
    with pytest.raises(RuntimeError, match="engine loop stopped"):
        loop.call(lambda e: None).result(1)


def test_an_engine_idle_after_work_trims_its_heap_once_per_idle_spell(engine):
    finished = threading.Event()

    def on_step(e, outputs):
        if any(out.finished for out in outputs):
            finished.set()

    loop = EngineLoop(engine, on_step=on_step, trim_after_idle_s=0.2)
    try:
        time.sleep(0.5)
        assert loop.num_trims == 0  # idle since it started: nothing freed to hand back
        for spell in (1, 2):
            finished.clear()
            loop.call(lambda e: e.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))).result(10)
            assert finished.wait(30)
            deadline = time.monotonic() + 10
            while loop.num_trims < spell and time.monotonic() < deadline:
                time.sleep(0.02)
            assert loop.num_trims == spell
            time.sleep(0.5)
            assert loop.num_trims == spell  # once, not on every idle turn of the loop
    finally:
        loop.stop()


def test_a_crashing_step_fails_waiters_instead_of_hanging(engine):
    def explode(e, outputs):
        raise RuntimeError("boom")

    loop = EngineLoop(engine, on_step=explode)
    loop.call(lambda e: e.add_request([1, 2, 3], SamplingParams(max_tokens=50))).result(10)
    loop._thread.join(30)
    assert isinstance(loop.error, RuntimeError) and not loop.alive
    with pytest.raises(RuntimeError, match="boom"):
        loop.call(lambda e: None).result(1)


def test_a_call_that_races_the_loop_dying_still_gets_its_answer(engine):
    """A command queued just after the loop's last drain must fail, not wait forever."""
    crash = threading.Event()

    def on_tick(e):
        if crash.is_set():
            raise RuntimeError("injected loop crash")

    loop = EngineLoop(engine, on_tick=on_tick)
    commands = loop._commands

    class LateQueue:  # the caller saw the loop alive; the loop dies before the command is queued
        get, get_nowait = commands.get, commands.get_nowait

        @staticmethod
        def put(item):
            crash.set()
            loop._thread.join(10)
            assert not loop._thread.is_alive()
            commands.put(item)

    loop._commands = LateQueue()  # type: ignore[assignment]
    future = loop.call(lambda e: "ran")
    with pytest.raises(RuntimeError, match=r"engine loop stopped.*injected loop crash"):
        future.result(5)


def test_build_in_passing_thread_returns_or_raises_what_the_build_did():
    caller = threading.get_ident()
    builders: list[int] = []

    def build() -> str:
        builders.append(threading.get_ident())
        return "built"

    assert build_in_passing_thread(build) == "built"
    assert builders and builders[0] != caller

    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_in_passing_thread(fail)


# Runs torch's parallel kernels on two threads in a fresh process, on the calling thread or on a passing one, and
# prints how many of the threads it started are still alive (libgomp keeps a team per thread that ran a region).
_TEAM_SCRIPT = """
import os, sys, time, torch
from pdserve.engine.engine_loop import build_in_passing_thread
torch.set_num_threads(2)
tasks = lambda: set(os.listdir("/proc/self/task"))
before = tasks()
work = lambda: torch.ones(4_000_000).mul_(2).sum().item()
build_in_passing_thread(work) if sys.argv[1] == "passing" else work()
deadline = time.monotonic() + 10
while tasks() - before and sys.argv[1] == "passing" and time.monotonic() < deadline:
    time.sleep(0.05)  # the team's threads leave after their thread
print(len(tasks() - before))
"""


@pytest.mark.parametrize(("where", "threads_left"), [("here", 1), ("passing", 0)])
def test_a_build_in_a_passing_thread_leaves_no_openmp_team_behind(where, threads_left):
    result = subprocess.run(
        [sys.executable, "-c", _TEAM_SCRIPT, where], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(result.stdout.strip()) == threads_left
