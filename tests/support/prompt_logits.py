"""The engine's logits for every prompt position, for the tests that compare them with `transformers`."""

from __future__ import annotations

import torch

from pdserve.engine import LLMEngine, SamplingParams


def engine_prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Run ``prompt`` through the engine's own scheduler (chunked by its token budget) and collect the
    logits of every position, one row each."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    rows = []
    while engine.get_request(request_id) is not None:
        output = engine.scheduler.schedule()
        rows.append(engine.runner.prompt_logits(output))
        engine.scheduler.update_after_step(output)
        if engine.get_request(request_id).num_computed_tokens == len(prompt):
            engine.abort(request_id)
    return torch.cat(rows)
