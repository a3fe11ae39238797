"""How many keys an attention call spans, and how many query rows it holds, so that a token's result does not
depend on its company.

A query row's attention over the same visible keys can still come out a few bits apart when the call holds
more or fewer keys, or more or fewer query rows: the CPU kernel (``scaled_dot_product_attention``'s flash
kernel) walks the keys in blocks of 512, and its matrix products choose how to cut a block's sums by the
block's length and by the number of query rows. A prompt chunked differently, or a decode grouped with a
longer request, would then get other bits, and where the next matrix product rounds its inputs to bfloat16
(the ``native`` weights on a CPU) other tokens now and then. Which spans cut the sums differently depends on
the CPU: spans of a few hundred keys, short of a whole block, do on the x86 CPUs tried, and on some of them
so do calls of 1-3 query rows against calls of more.

The kernel also walks the query rows in blocks (``query_block_rows``: 32 rows, 64 from 192 rows on, 256 from
768 on), and on such a CPU a block of 1-3 rows takes the other path: the last rows of a call whose last block
is that short (a chunk of 22 tokens of a model with 3 query heads per KV head: 66 rows, a last block of 2) get
other bits than in any other call, so a prompt's answer could depend on how many of its tokens came from the
prefix cache.

The engine therefore attends over the visible keys in whole KV blocks, in pieces of at most ``KEY_PIECE``
keys at fixed absolute offsets (0, 192, 384, ...): one call per piece, whose results are combined by their
log-sum-exp, piece after piece in order; a piece whose keys a row cannot see weighs exactly zero, so a row
gets the same bits whatever the call's span (a decode beside a longer request, a chunk of a longer prompt),
and a short span costs its own pieces, not a padded block of 512. And ``attend`` gives every call
``padded_query_rows`` query rows per head (repeating the last): at least ``MIN_QUERY_ROWS``, and a last block
of the kernel's of none or at least ``MIN_QUERY_ROWS``. ``attention_is_width_invariant`` checks at start-up,
on random data, that this device's kernel then gives every row the same bits at every span, alone or beside
other rows, in a prefill chunk's layout or in a decode batch's; ``--quantization auto`` keeps the ``native``
path only where it does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KEY_PIECE = 192  # keys per attention call: spans up to this are cut-free on the CPUs tried (whole blocks)
MIN_QUERY_ROWS = 4  # fewer query rows per head take another path through the kernel's products (on some CPUs)


def query_block_rows(rows: int) -> int:
    """The query rows per block of the CPU flash kernel in a call of ``rows`` query rows per head."""
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def padded_query_rows(rows: int) -> int:
    """The query rows per head ``attend`` hands the kernel for ``rows``: at least ``MIN_QUERY_ROWS``, and so many
    that the kernel's last block of rows (``query_block_rows``) is whole or holds at least ``MIN_QUERY_ROWS``."""
    padded = max(rows, MIN_QUERY_ROWS)
    while 0 < (tail := padded % query_block_rows(padded)) < MIN_QUERY_ROWS:
        padded += MIN_QUERY_ROWS - tail
    return padded


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention(query, keys, values, attn_mask=mask)`` (``mask`` boolean, True = visible),
    on a CPU over ``padded_query_rows`` query rows per head (the extra rows copies of the last, their results
    dropped) and, beyond ``KEY_PIECE`` keys, piece by piece (``_attend_in_pieces``)."""
    if query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    rows = query.shape[-2]
    padded = padded_query_rows(rows)
    if padded != rows:
        query = _padded_rows(query, padded)
        mask = mask if mask.shape[-2] == 1 else _padded_rows(mask, padded)
    if keys.shape[-2] <= KEY_PIECE:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    else:
        out = _attend_in_pieces(query, keys, values, mask)
    return out if padded == rows else out[..., :rows, :]


def _attend_in_pieces(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention over keys ``[0, 192)``, ``[192, 384)``, ... one call each, combined by log-sum-exp in that order.
    A piece a row sees nothing of gets a log-sum-exp of -inf (the kernel reports 0 there), so it adds exact zeros:
    a row's result does not depend on how many pieces follow the last one it sees."""
    additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
    pieces = []
    for lo in range(0, keys.shape[-2], KEY_PIECE):
        hi = lo + KEY_PIECE
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys[..., lo:hi, :], values[..., lo:hi, :], attn_mask=additive[..., lo:hi]
        )
        pieces.append((out, torch.where(mask[..., lo:hi].any(-1), lse, float("-inf"))))
    top = pieces[0][1]
    for _, lse in pieces[1:]:
        top = torch.maximum(top, lse)
    total = weights = None
    for out, lse in pieces:
        weight = torch.exp(lse - top).unsqueeze(-1)
        term = out * weight
        total = term if total is None else total + term
        weights = weight if weights is None else weights + weight
    assert total is not None and weights is not None
    return (total / weights).to(query.dtype)  # the log-sum-exps are float32 whatever the query's dtype


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t``'s rows (its second-to-last dimension), then copies of its last row: ``rows`` in all."""
    extra = rows - t.shape[-2]
    return torch.cat((t, t[..., -1:, :].expand(*t.shape[:-2], extra, t.shape[-1])), dim=-2)


PROBE_POSITIONS = (0, 15, 100, 191, 192, 255, 271, 300, 450, 511, 512, 600, 700, 1000, 1023, 1500)
PROBE_MAX_KEYS = 1536
# every whole block across the first two pieces' boundaries, then spans ending in each place of a piece
PROBE_SPANS = (*range(16, 417, 16), 464, 576, 704, 1024, 1200, PROBE_MAX_KEYS)


@functools.cache
def attention_is_width_invariant(device_type: str = "cpu") -> bool:
    """Whether ``attend`` on this device gives a query row the same bits at every span of whole KV blocks up to
    ``PROBE_MAX_KEYS`` keys (``PROBE_SPANS``): alone, beside other rows and as one request of a decode batch, in the
    engine's layouts (keys gathered as ``[span, kv_heads, head_dim]`` rows; a prefill chunk's query heads of one
    KV head as its rows, among them chunks whose last rows fall in a short last block of the kernel's; a decode
    batch's as one request's). Cached: it runs once per process, at start-up."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, group, dim = 3, 3, 64
    keys = torch.randn(PROBE_MAX_KEYS, kv_heads, dim, generator=generator).to(device_type)
    values = torch.randn(PROBE_MAX_KEYS, kv_heads, dim, generator=generator).to(device_type)
    queries = torch.randn(PROBE_MAX_KEYS, kv_heads, group, dim, generator=generator).to(device_type)
    first: dict[int, torch.Tensor] = {}

    def agrees(position: int, row: torch.Tensor) -> bool:
        seen = first.setdefault(position, row)
        return seen is row or torch.equal(seen, row)

    for span in PROBE_SPANS:
        probed = [p for p in PROBE_POSITIONS if p < span]
        k, v = keys[:span].transpose(0, 1).unsqueeze(0), values[:span].transpose(0, 1).unsqueeze(0)
        key_positions = torch.arange(span, device=device_type)
        last = probed[-1]  # last in a chunk of 11 or 22 tokens: 33 or 66 rows, the kernel's last block 1 or 2 rows
        short_tails = [list(range(last - n + 1, last + 1)) for n in (11, 22) if last >= n - 1]
        for positions in ([last], probed, probed + list(range(span - 40, span)), *short_tails):
            rows = len(positions)
            query = queries[positions].permute(1, 2, 0, 3).reshape(1, kv_heads, group * rows, dim)
            mask = key_positions <= torch.tensor(positions, device=device_type)[:, None]
            out = attend(query, k, v, mask.repeat(group, 1)).view(kv_heads, group, rows, dim)
            if not all(agrees(p, out[:, :, i]) for i, p in enumerate(positions) if p in PROBE_POSITIONS):
                return False
        n = len(probed)  # a decode batch: each probed position one request, its keys padded to the span
        mask = (key_positions <= torch.tensor(probed, device=device_type)[:, None]).view(n, 1, 1, span)
        out = attend(queries[probed], k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), mask)
        if not all(agrees(p, out[i]) for i, p in enumerate(probed)):
            return False
    return True
