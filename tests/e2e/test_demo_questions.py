"""The demo's questions answered by SmolLM2 through the router in every mode, as the offline engine answers them."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="smollm2",
            device="cpu",
            dtype="float32",
            quantization="none",  # the exact float path, compared with transformers
            max_num_batched_tokens=64,
            num_kv_blocks=256,
            enable_prefix_caching=False,  # every prompt position computed, for the logits comparison
        )
    )


@pytest.mark.cluster
def test_the_demo_answers_through_the_router_in_every_mode(engine, capsys):
    import argparse

    from pdserve.cli.demo import DEMO_QUESTIONS, ask_questions

    ask_questions(argparse.Namespace(model="smollm2", transport="nixl"))
    out = capsys.readouterr().out
    answers = [line.split("A: ", 1)[1] for line in out.splitlines() if line.strip().startswith("A: ")]
    metadata = [line for line in out.splitlines() if line.strip().startswith("mode:")]
    assert len(answers) == len(metadata) == len(DEMO_QUESTIONS)
    first = engine.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_QUESTIONS[0][1]}])
    [expected] = engine.generate([first], SamplingParams(max_tokens=48, temperature=0.0))
    assert answers[0] == expected.text.strip() and "Paris" in answers[0]  # the offline engine's greedy answer
    assert all(len(answer.split()) >= 3 for answer in answers)  # words, every one
    served_modes = [line.split()[1] for line in metadata]  # "mode:   colocated"
    assert served_modes == ["colocated", "disaggregated", "colocated", "disaggregated"]
