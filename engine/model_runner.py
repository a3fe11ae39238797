"""Turns a scheduler step into tensors, runs the model over the paged KV pool, samples tokens."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model import AttentionMetadata, LlamaForCausalLM, PrefillSpan
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput


def kv_block_shape(config: ModelConfig, block_size: int) -> tuple[int, ...]:
    """One block holds K and V of ``block_size`` tokens for every layer, contiguously."""
    return (config.num_hidden_layers, 2, block_size, config.num_key_value_heads, config.head_dim)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    n = 1
    for d in kv_block_shape(config, block_size):
        n *= d
    return n * torch.empty(0, dtype=dtype).element_size()


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The block-major pool: ``pool[b]`` is block ``b``, one contiguous region (one transfer descriptor)."""
    return torch.zeros((num_blocks, *kv_block_shape(config, block_size)), dtype=dtype, device=device)


class StepResult:
    """Sampled tokens for the chunks that sample, keyed by request id; logits when asked for."""

    __slots__ = ("logits", "tokens")

    def __init__(self, tokens: dict[str, int], logits: dict[str, torch.Tensor] | None) -> None:
        self.tokens = tokens
        self.logits = logits


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def run(self, output: SchedulerOutput, params: dict[str, SamplingParams], seeds: dict[str, int],
            output_index: dict[str, int], keep_logits: bool = False) -> StepResult:
        """Compute every scheduled chunk; sample for chunks that reach their request's last token.

        ``output_index[rid]`` is the index of the output token being sampled (the draw's seed input).
        """
        input_ids, positions, meta = self._prepare(output)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        sampling = [c for c in output.chunks if c.samples]
        if not sampling:
            return StepResult({}, {} if keep_logits else None)
        last_index, flat = [], 0
        for chunk in output.chunks:
            flat += len(chunk.token_ids)
            if chunk.samples:
                last_index.append(flat - 1)
        logits = self.model.logits(hidden[torch.tensor(last_index, device=self.device)])
        ids = [c.request_id for c in sampling]
        tokens = sample(logits, [params[r] for r in ids], [seeds[r] for r in ids], [output_index[r] for r in ids])
        kept = {r: logits[i].cpu() for i, r in enumerate(ids)} if keep_logits else None
        return StepResult(dict(zip(ids, tokens, strict=True)), kept)

    @torch.inference_mode()
    def prompt_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token (tests compare them against a reference model)."""
        input_ids, positions, meta = self._prepare(output)
        return self.model.logits(self.model(input_ids, positions, self.kv_cache, meta))

    def _prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        for chunk in output.chunks:
            lo, n = len(ids), len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            for p in range(chunk.start, chunk.start + n):
                pos.append(p)
                slot_blocks.append(chunk.block_ids[p // bs])
                slot_offsets.append(p % bs)
            if n == 1 and chunk.start > 0:
                decode_index.append(lo)
                decode_tables.append(chunk.block_ids[: (chunk.start + bs) // bs])
                decode_lens.append(chunk.start + 1)
            else:
                num_blocks = -(-(chunk.start + n) // bs)
                prefills.append(PrefillSpan(lo, lo + n, chunk.start, self._tensor(chunk.block_ids[:num_blocks])))
        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=self._tensor(slot_offsets),
            decode_index=None,
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_index:
            width = max(len(t) for t in decode_tables)
            tables = self._tensor([t + [0] * (width - len(t)) for t in decode_tables])
            lens = self._tensor(decode_lens)
            key_pos = torch.arange(width * bs, device=self.device)
            meta.decode_index = self._tensor(decode_index)
            meta.decode_block_tables = tables
            meta.decode_mask = (key_pos.unsqueeze(0) < lens.unsqueeze(1)).view(len(decode_index), 1, 1, -1)
        return self._tensor(ids), self._tensor(pos), meta

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def gather_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The K/V of a request's first ``num_tokens`` tokens: [layers, 2, num_tokens, kv_heads, head_dim]."""
    blocks = kv_cache[torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)]
    layers, _, _, heads, dim = blocks.shape[1:]
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, -1, heads, dim)[:, :, :num_tokens].cpu()
