"""How many keys an attention call spans, so that a token's result does not depend on its company.

A query row's attention over the same visible keys can still come out a few bits apart when the call holds
more or fewer keys: the CPU kernel (``scaled_dot_product_attention``'s flash kernel) walks the keys in
blocks of 512 and its matrix products split a block's keys by its length, so keys hidden by the mask
change where the sums are cut. A prompt chunked differently, or a decode grouped with a longer request,
would then get other bits, and where the next matrix product rounds its inputs to bfloat16 (the ``native``
weights on a CPU) other tokens now and then.

The engine therefore attends over ``attended_keys(n)`` keys: ``n`` rounded up to whole blocks while it is
at most ``SHORT_KEYS``, to a multiple of ``KEY_BLOCK`` beyond (the masked tail costs at most one block of
512). ``attention_is_width_invariant`` checks at start-up, on random data, that this CPU's kernel gives every
row the same bits at every such width; ``--quantization auto`` keeps the ``native`` path only where it does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SHORT_KEYS = 256  # up to this many keys, one cut-free span: any whole number of blocks
KEY_BLOCK = 512  # the flash kernel's block of keys; longer spans are a whole number of them


def attended_keys(keys: int) -> int:
    """The keys an attention call over ``keys`` visible ones spans (the rest masked)."""
    return keys if keys <= SHORT_KEYS else -(-keys // KEY_BLOCK) * KEY_BLOCK


def attended_blocks(blocks: int, block_size: int) -> int:
    """``attended_keys`` in whole KV blocks, for a request holding ``blocks`` of them."""
    return -(-attended_keys(blocks * block_size) // block_size)


PROBE_POSITIONS = (0, 15, 100, 255, 256, 271, 450, 511, 512, 600, 1000, 1023, 1500)
PROBE_MAX_KEYS = 2048


@functools.cache
def attention_is_width_invariant(device_type: str = "cpu") -> bool:
    """Whether ``scaled_dot_product_attention`` on this device gives a query row the same bits at every span
    ``attended_keys`` allows up to ``PROBE_MAX_KEYS`` keys, alone and beside other rows, in the engine's
    layout (the query heads of one KV head as its rows, a boolean mask). About 0.03 s on a 2-core CPU."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, group, dim = 3, 3, 64
    keys = torch.randn(1, kv_heads, PROBE_MAX_KEYS, dim, generator=generator).to(device_type)
    values = torch.randn(1, kv_heads, PROBE_MAX_KEYS, dim, generator=generator).to(device_type)
    queries = torch.randn(PROBE_MAX_KEYS, kv_heads, group, dim, generator=generator).to(device_type)
    spans = sorted({attended_keys(n) for n in range(16, PROBE_MAX_KEYS + 1, 16)})
    first: dict[int, torch.Tensor] = {}
    for span in spans:
        probed = [p for p in PROBE_POSITIONS if p < span]
        for neighbours in (0, 40):  # alone, and beside rows near the end of the span
            positions = probed + list(range(span - neighbours, span))
            rows = len(positions)
            query = queries[positions].permute(1, 2, 0, 3).reshape(1, kv_heads, group * rows, dim)
            mask = torch.arange(span, device=device_type) <= torch.tensor(positions, device=device_type)[:, None]
            out = F.scaled_dot_product_attention(
                query, keys[:, :, :span], values[:, :, :span], attn_mask=mask.repeat(group, 1)
            ).view(kv_heads, group, rows, dim)
            for i, position in enumerate(probed):
                row = out[:, :, i]
                seen = first.setdefault(position, row)
                if seen is not row and not torch.equal(seen, row):
                    return False
    return True
