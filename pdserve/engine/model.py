"""Llama-family decoder over a paged, block-major KV cache.

RMSNorm, RoPE (with Llama-3 scaling), grouped-query attention, SwiGLU MLP, tied or untied embeddings,
optional q/k/v bias (Qwen2). Module names follow Hugging Face's, so a checkpoint's state dict loads
as it is. The batch is flat: ``T`` tokens from many requests, each at its absolute position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from pdserve.engine.attention_width import attend
from pdserve.engine.config import ModelConfig
from pdserve.engine.quantization import Int4Linear, Int8Linear


@dataclass
class PrefillSpan:
    """A run of ``hi - lo`` new tokens of one request, at absolute positions ``start ..``."""

    lo: int  # index of the first token in the flat batch
    hi: int
    start: int  # tokens of this request already in the cache
    block_ids: torch.Tensor  # the request's blocks, covering start + (hi - lo) slots
    # [group * (hi - lo), blocks * block_size], True = a key the query row sees; row g * n + i = query head g of
    # a KV head's group, token i (absolute position start + i), which sees keys 0 .. start + i. None: the
    # blocks are not padded, and the kernel applies the causal mask itself (``_causal_prefill_attention``)
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Single-token queries of requests with similar context lengths, attended in one SDPA call.

    Requests are sorted by context length before grouping, so padding each to the group's longest
    costs little; the mask hides the padding.
    """

    index: torch.Tensor  # [n] flat index of each query
    flat_block_ids: torch.Tensor  # [n * width] each request's blocks, padded with block 0 to the group's longest
    mask: torch.Tensor  # [n, 1, 1, width * block_size], True = a real cached key


class Workspace:
    """Reusable gather buffers: a fresh multi-MiB tensor per layer and step costs page faults."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        n = rows * like.shape[1]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(int(n * 1.25), dtype=like.dtype, device=like.device)
        return buf[:n].view(rows, like.shape[1])


def pool_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool ``[blocks, layers, 2, block_size, kv_heads, head_dim]`` as one row per token slot
    (``[-1, kv_heads * head_dim]``). A token at offset ``o`` of block ``b`` has its layer-0 key in row
    ``b * layers * 2 * block_size + o``; the key of layer ``l`` is ``2 * l * block_size`` rows further, its
    value ``block_size`` rows after that."""
    return kv_cache.view(-1, kv_cache.shape[-2] * kv_cache.shape[-1])


class LayerCache(NamedTuple):
    """One layer's views of the pool, made once per pool (``layer_caches``): a step's operators then start
    from them instead of slicing the pool again in every layer."""

    new_keys: torch.Tensor  # ``pool_rows`` from this layer's first key on: a token's key goes to its slot row
    new_values: torch.Tensor  # the same from its first value on
    key_blocks: torch.Tensor  # [num_blocks, block_size * kv_heads * head_dim]: one row per block, for gathers
    value_blocks: torch.Tensor


def layer_caches(kv_cache: torch.Tensor) -> list[LayerCache]:
    """Every layer's ``LayerCache`` over the pool ``[blocks, layers, 2, block_size, kv_heads, head_dim]``."""
    rows, layers, block_size = pool_rows(kv_cache), kv_cache.shape[1], kv_cache.shape[3]
    return [
        LayerCache(
            rows[2 * layer * block_size :],
            rows[(2 * layer + 1) * block_size :],
            kv_cache[:, layer, 0].reshape(kv_cache.shape[0], -1),
            kv_cache[:, layer, 1].reshape(kv_cache.shape[0], -1),
        )
        for layer in range(layers)
    ]


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes, and which cached keys each query may see."""

    slot_rows: torch.Tensor  # [T] each new token's row in the pool's layer-0 keys, as ``pool_rows`` numbers them
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    workspace: Workspace
    caches: list[LayerCache]  # the pool's views, one per layer (``layer_caches``)


FEW_ROWS = 4  # up to this many rows, a float32 product on the CPU runs as a two-batch matrix product


class Linear(nn.Linear):
    """``nn.Linear`` whose products of a few float32 rows on the CPU run as a two-batch matrix product.

    For one row ``F.linear`` ends in MKL's matrix-vector kernel, which on AMD CPUs streams the weights far
    slower than MKL's matrix product with one column (``benchmarks/decode_speed.py --kernels`` times both on
    the machine at hand). Splitting the weight's rows into two halves and multiplying both by
    the same rows (a stride-0 batch) takes that faster path; the results agree with ``F.linear`` to float32
    rounding. A decode step of a small batch is one such product per layer, so this is most of its time.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows, (n, k) = x.shape[0], w.shape
        if (
            x.dim() == 2
            and rows <= FEW_ROWS
            and n % 2 == 0
            and x.device.type == "cpu"
            and x.dtype == w.dtype == torch.float32
            and w.is_contiguous()
        ):
            y = torch.bmm(w.view(2, n // 2, k), x.t().expand(2, k, rows))  # [2, n/2, rows]
            y = y.view(1, n) if rows == 1 else y.permute(2, 0, 1).reshape(rows, n)
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``parts`` side by side (their outputs concatenated), or None unless every part is
    a plain float linear, or every one an ``Int4Linear`` or an ``Int8Linear`` that can be joined, on one input:
    one product per layer instead of three (q, k, v) or two (gate, up) saves a kernel call's overhead and, for
    one row, small inefficient matrix-vector products."""
    for kind in (Int4Linear, Int8Linear):
        if all(type(p) is kind for p in parts):
            return kind.concatenate(parts)  # type: ignore[arg-type]
    if not all(type(p) in (Linear, nn.Linear) for p in parts):
        return None
    linears: list[nn.Linear] = parts  # type: ignore[assignment]
    biased = [p.bias is not None for p in linears]
    if any(biased) and not all(biased):
        return None
    weight = torch.cat([p.weight.detach() for p in linears])
    with torch.device("meta"):
        fused = Linear(linears[0].in_features, weight.shape[0], bias=all(biased))
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if all(biased):
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in linears]), requires_grad=False)
    return fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # one fused call; the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"model config: unsupported rope scaling type {kind!r} (default, linear, llama3)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every absolute position (the rotate-half convention of HF Llama)."""

    cos: torch.Tensor  # [max positions, head_dim / 2], float32 (buffers, so they follow .to())
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if not self.cos.is_meta:
            self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 cos/sin tables on the module's device (after a meta build or a cast)."""
        device = self.cos.device
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, rope_inv_freq(self.config).double())
        self.cos, self.sin = freqs.cos().float().to(device), freqs.sin().float().to(device)

    def angles(self, positions: torch.Tensor) -> Rotation:
        """The rotation of ``positions``, gathered once per step for every layer."""
        cos, sin = self.cos[positions], self.sin[positions]
        return Rotation(torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1))


class Rotation(NamedTuple):
    """The rotation of a step's tokens (``RotaryEmbedding.angles``), applied to q and k in every layer:
    ``[x1, x2]`` becomes ``[x1 cos - x2 sin, x2 cos + x1 sin]``, computed as ``x * cos + [x2, x1] * signed_sin``
    (the same products and sums, so the same bits, in four operators instead of eight)."""

    cos: torch.Tensor  # [T, 1, D]: cos twice
    signed_sin: torch.Tensor  # [T, 1, D]: -sin, then sin

    def apply(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for x in xs:
            x32 = x if x.dtype == torch.float32 else x.float()
            rotated = x32 * self.cos + x32.roll(x.shape[-1] // 2, dims=-1) * self.signed_sin
            out.append(rotated if rotated.dtype == x.dtype else rotated.to(x.dtype))
        return tuple(out)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj: nn.Module | None = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj: nn.Module | None = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj: nn.Module | None = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one product, once fused (``fuse``)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def fuse(self) -> bool:
        """Replace q/k/v_proj by one ``qkv_proj`` where ``fuse_linears`` can join them (after loading)."""
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])  # type: ignore[list-item]
        if fused is not None:
            self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = fused, None, None, None
        return fused is not None

    def forward(self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata) -> torch.Tensor:
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            # q and k are adjacent in each row: rotated together, in one pass
            (qk,) = rotation.apply(qkv[:, : (H + KV) * D].view(T, H + KV, D))
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q = self.q_proj(x).view(T, H, D)
            k = self.k_proj(x).view(T, KV, D)
            v = self.v_proj(x).view(T, KV, D)
            q, k = rotation.apply(q, k)

        # the new keys and values: one index_copy_ each into the rows of this layer (index_put_ with a block and
        # an offset index wakes every OpenMP thread, a cost per call under a passive wait policy); rows past the
        # step's tokens (``LlamaForCausalLM.batch_rows``) are padding, neither stored nor attended
        cache = meta.caches[self.layer_index]
        n = meta.slot_rows.numel()
        cache.new_keys.index_copy_(0, meta.slot_rows, k[:n].to(cache.new_keys.dtype).reshape(n, -1))
        cache.new_values.index_copy_(0, meta.slot_rows, v[:n].to(cache.new_values.dtype).reshape(n, -1))

        # one row per block: index_select over rows gathers a request's blocks with one memcpy per block
        k_rows, v_rows = cache.key_blocks, cache.value_blocks
        out = torch.empty_like(q)
        out[n:].zero_()
        for group in meta.decode_groups:
            out.index_copy_(0, group.index, self._decode_attention(q, k_rows, v_rows, group, meta.workspace))
        for span in meta.prefills:
            if span.mask is None:
                out[span.lo : span.hi] = self._causal_prefill_attention(q, k_rows, v_rows, span)
            else:
                out[span.lo : span.hi] = self._prefill_attention(q, k_rows, v_rows, span)
        return self.o_proj(out.view(T, -1))

    def _decode_attention(self, q, k_rows, v_rows, group: DecodeGroup, workspace: Workspace) -> torch.Tensor:
        n, rows = group.index.numel(), group.flat_block_ids.numel()
        keys = torch.index_select(k_rows, 0, group.flat_block_ids, out=workspace.get("k", rows, k_rows))
        values = torch.index_select(v_rows, 0, group.flat_block_ids, out=workspace.get("v", rows, v_rows))
        keys = keys.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2).to(q.dtype)  # [n, kv_heads, S, D]
        values = values.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2).to(q.dtype)
        # The query heads that share a KV head are that head's query rows ([n, kv_heads, group, D]): one pass
        # over each KV head's keys, where enable_gqa makes one per query head (on a CPU, a large share of
        # SDPA's time). 4-D inputs keep SDPA on its fused CPU kernel (3-D ones fall back to the
        # slow math path).
        query = q.index_select(0, group.index).view(n, self.num_kv_heads, self.num_heads // self.num_kv_heads, -1)
        return attend(query, keys, values, group.mask).reshape(n, self.num_heads, self.head_dim)

    def _prefill_attention(self, q, k_rows, v_rows, span: PrefillSpan) -> torch.Tensor:
        """A chunk's queries over every cached key of its request, its own included (written just before).

        Every chunk takes this one path, over the keys as the cache holds them (rounded to its dtype), through
        ``attend`` (as decodes): a token's attention then comes out the same whatever chunk it falls in, so a
        prompt's results do not depend on how it was chunked, nor on whether its tokens were prefilled or decoded.
        """
        n, H, KV, D = span.hi - span.lo, self.num_heads, self.num_kv_heads, self.head_dim
        group = H // KV
        keys = torch.index_select(k_rows, 0, span.block_ids).view(-1, KV, D)  # [span, KV, D]
        values = torch.index_select(v_rows, 0, span.block_ids).view(-1, KV, D)
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KV, S, D]
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        # as in decode attention, the query heads that share a KV head are its query rows: [1, KV, group * n, D],
        # row g * n + i = its head g, token i
        query = q[span.lo : span.hi].view(n, KV, group, D).permute(1, 2, 0, 3).reshape(1, KV, group * n, D)
        assert span.mask is not None
        out = attend(query, keys, values, span.mask)
        return out.view(KV, group, n, D).permute(2, 0, 1, 3).reshape(n, H, D)

    def _causal_prefill_attention(self, q, k_rows, v_rows, span: PrefillSpan) -> torch.Tensor:
        """A chunk's queries over exactly the ``start + n`` keys of its request so far, under the causal mask
        aligned to the last key that SDPA's kernels build themselves (no boolean mask, no padded keys): on
        CUDA the flash kernel takes it. Each query head gets its KV head's keys, so every kernel accepts the
        layout, on every torch the project admits. The GPU path; on a CPU for tests only."""
        n, H, KV, D = span.hi - span.lo, self.num_heads, self.num_kv_heads, self.head_dim
        length = span.start + n
        keys = torch.index_select(k_rows, 0, span.block_ids).view(-1, KV, D)[:length]
        values = torch.index_select(v_rows, 0, span.block_ids).view(-1, KV, D)[:length]
        keys, values = (
            t.transpose(0, 1).unsqueeze(1).expand(KV, H // KV, length, D).reshape(1, H, length, D).to(q.dtype)
            for t in (keys, values)
        )
        query = q[span.lo : span.hi].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.start == 0:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(n, length))
        return out[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj: nn.Module | None = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj: nn.Module | None = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one product, once fused (``fuse``)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def fuse(self) -> bool:
        """Replace gate/up_proj by one ``gate_up_proj`` where ``fuse_linears`` can join them (after loading)."""
        fused = fuse_linears([self.gate_proj, self.up_proj])  # type: ignore[list-item]
        if fused is not None:
            self.gate_up_proj, self.gate_proj, self.up_proj = fused, None, None
        return fused is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rotation: Rotation, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rotation = self.rotary_emb.angles(positions)
        for layer in self.layers:
            x = layer(x, rotation, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states of every token; ``logits`` projects the chosen ones."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Fuse every layer's q/k/v and gate/up projections into one product each, where they are float
        linears or int4/int8 ones ``fuse_linears`` can join. Call after the weights are loaded, before serving."""
        with torch.no_grad():
            fused = False
            for layer in self.model.layers:
                assert isinstance(layer, DecoderLayer)
                fused |= layer.self_attn.fuse()
                fused |= layer.mlp.fuse()
            if not fused:
                return
            # own copies of the other weights too: a memory-mapped checkpoint's pages, all read once by the
            # fusion, would otherwise stay resident beside the fused copies
            for param in self.parameters():
                param.data = param.data.clone()

    def batch_rows(self, tokens: int) -> int:
        """The rows a step of ``tokens`` tokens runs on: where the linears are float16 ones on FBGEMM, the next
        count whose rows it computes exactly as in any other batch (``RowPadding``), so that no layer pads its
        input again (a copy of the whole activation matrix per product); else ``tokens``."""
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)
        padding = getattr(layer.mlp.down_proj, "padding", None)
        return tokens if padding is None else padding.rows_for(tokens)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every row of ``input_ids``; rows past ``meta.slot_rows`` are padding."""
        return self.model(input_ids, positions, meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
