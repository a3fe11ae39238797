"""Weight-only quantized layers: a GGUF file's Q4_0/Q4_1 and Q8_0 weights kept as they ship.

``--quantization`` chooses (``EngineConfig.quantization``):

- ``none``: every weight is dequantised to ``--dtype`` (the exact float path);
- ``native``: Q4_0/Q4_1 weights run as torch's packed int4 weight-only GEMM with the file's per-32 scales
  and minimums (exact: ``w = d * q + m``), Q8_0 ones as int8 weight-only GEMM (one scale per row,
  re-derived from the per-32 ones); q/k/v and gate/up are joined into one GEMM each, as float ones are;
  other tensors are dequantised to the compute dtype. On a CPU under ``--dtype auto`` the model computes
  in float32 and the GEMMs take bfloat16 inputs (``weight_only_input_dtype``; torch's kernels are far slower
  with float32 inputs), with a float16 KV cache and, on x86, a float16 output projection on FBGEMM (float32 logits);
- ``float16``: every weight (linears and the embedding) stored in float16, half float32's bytes, and
  computed in float32 (``Float16Linear``). On x86 builds of torch one kernel does every batch size:
  FBGEMM's float16-weight GEMM (weights converted to float32 in registers, float32 accumulation), with
  small batches padded by a few zero rows where its short-remainder kernels would sum in another order, so
  a row's result is the same in any batch (``fbgemm_float16_padding`` finds the padding on the CPU it runs
  on). Elsewhere a batch of one or two rows goes through torch's float16 matrix-vector kernel and larger
  ones convert the weight to float32 a cache-sized tile at a time; inputs and outputs are rounded to
  float16 on both of those paths, for the same invariance. The output projection keeps float32 logits
  (float16 ones would tie a confident model's top tokens);
- ``auto``: for a GGUF file with Q4/Q8 weights, ``native`` on CUDA and on a CPU torch runs at AVX-512 where
  attention keeps a row's bits independent of its company (probed at start-up, ``auto_weight_format``):
  there it decodes one stream faster than ``float16`` in less memory (it reads about a quarter of the weights'
  bytes), while long prompts and large batches run as fast or slower (torch's int4 kernel can cost more per
  row than FBGEMM's beyond a few rows: ``float16`` is the choice for throughput on such a CPU; docs/engine.md
  has the figures). Else
  ``float16`` on a CPU where torch has FBGEMM, ``none`` elsewhere (there torch's int4/int8 kernels are
  slower than a float32 GEMM over the dequantised weights). A checkpoint that is not such a GGUF file is
  served as it is (``none``).

The compute dtype of the ``native`` path (``--dtype auto``) is bfloat16 on CUDA, float32 on a CPU. On CUDA
``native`` keeps only Q4_0/Q4_1 weights, and only where torch's int4 GEMM (``_weight_int4pack_mm``) takes
them: bfloat16 activations, torch 2.5 or later (uint8-packed codes), an Ampere or later GPU
(``native_weight_kinds``). Q8_0 weights are dequantised to the compute dtype there: torch's CUDA int8
weight-only GEMM is a plain kernel (one thread per output element), slower than a bfloat16 GEMM over the
dequantised weights, and exists only in recent torch. The CUDA int4 kernel has not been run on a GPU yet.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention_width import attention_is_width_invariant
from pdserve.engine.config import QUANTIZATION_MODES
from pdserve.engine.gguf import QUANT_GROUP, QuantizedBlocks

__all__ = [
    "QUANTIZATION_MODES",
    "Float16Embedding",
    "Float16Linear",
    "Int4Linear",
    "Int8Embedding",
    "Int8Linear",
    "Int8Weight",
]
INT4_KINDS = frozenset({"Q4_0", "Q4_1"})
INT8_KINDS = frozenset({"Q8_0"})
CUDA_INT4_TORCH = (2, 5)  # from this torch on, _convert_weight_to_int4pack takes uint8 pairs of codes (pack_int4)
CUDA_INT4_CAPABILITY = (8, 0)  # torch's int4 CUDA GEMM (tinygemm) runs on bfloat16 tensor cores: Ampere on
log = logging.getLogger(__name__)


class NativeKinds(NamedTuple):
    """The GGUF block kinds ``--quantization native`` keeps as they ship on a device, and why the other
    quantized kinds are dequantised to the compute dtype there ("" when none is)."""

    kinds: frozenset[str]
    why_not: str


def native_weight_kinds(
    device: torch.device,
    compute_dtype: torch.dtype,
    capability: tuple[int, int] | None = None,
    torch_version: str | None = None,
) -> NativeKinds:
    """What the ``native`` path keeps on ``device`` with activations in ``compute_dtype``: on a CPU the kinds
    whose kernels this torch has (``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``, both in recent
    torch only); on CUDA Q4_0/Q4_1 alone, and only with bfloat16 activations, torch >= 2.5 and a GPU of
    compute capability 8.0 or more. ``capability`` and ``torch_version`` default to the GPU's and torch's
    own (a test asks about a CUDA device without one)."""
    if device.type != "cuda":
        kept: set[str] = set()
        missing = []
        for kinds, op in ((INT4_KINDS, "_weight_int4pack_mm_for_cpu"), (INT8_KINDS, "_weight_int8pack_mm")):
            if hasattr(torch.ops.aten, op):
                kept |= kinds
            else:
                missing.append(f"{'/'.join(sorted(kinds))}: this torch has no {op}")
        return NativeKinds(frozenset(kept), "; ".join(missing))
    why_not = ["Q8_0: torch's CUDA int8 weight-only GEMM is slower than a bfloat16 GEMM"]
    version = torch.torch_version.TorchVersion(torch_version or torch.__version__)
    too_old = version < CUDA_INT4_TORCH  # type: ignore[operator]  # TorchVersion compares with tuples
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if compute_dtype != torch.bfloat16:
        dtype_name = str(compute_dtype).removeprefix("torch.")
        why_not.insert(0, f"Q4: torch's CUDA int4 GEMM takes bfloat16 activations, not {dtype_name}")
    elif too_old or not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        why_not.insert(0, f"Q4: torch's CUDA int4 GEMM needs torch 2.5 or later, this is {version}")
    elif tuple(capability) < CUDA_INT4_CAPABILITY:
        why_not.insert(0, f"Q4: torch's CUDA int4 GEMM needs compute capability 8.0, this GPU has {capability}")
    else:
        return NativeKinds(INT4_KINDS, why_not[0])
    return NativeKinds(frozenset(), "; ".join(why_not))


def fast_weight_only_kernels(device: torch.device) -> bool:
    """Whether torch's int4/int8 weight-only GEMMs beat a float GEMM here: CUDA, or a CPU torch runs at AVX-512."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))


FBGEMM_PROBE_ROWS = 360  # a multiple of every row block FBGEMM's float16 kernels use (up to 120 on AVX2)


class RowPadding(NamedTuple):
    """How many rows to hand FBGEMM's float16 GEMM so that each row's result is the same in any batch.

    The GEMM splits a batch into blocks of rows and gives a short remainder (one or two rows, on AVX2) a
    kernel that sums in another order, a few ulps apart. Padding with zero rows to a count whose split has
    no such block gives every row the result it would have in any other batch.
    """

    table: tuple[int, ...]  # table[m]: the rows to compute for m rows, m <= FBGEMM_PROBE_ROWS
    multiple: int  # beyond the table: the next multiple of this

    def rows_for(self, rows: int) -> int:
        if rows < len(self.table):
            return self.table[rows]
        return -(-rows // self.multiple) * self.multiple


@functools.cache
def fbgemm_float16_padding() -> RowPadding | None:
    """The padding under which FBGEMM's float16-weight GEMM (x86 builds of torch: weights packed in float16,
    converted to float32 in registers, float32 accumulation) is batch-invariant on this CPU, found by trying
    every batch of up to ``FBGEMM_PROBE_ROWS`` rows against the full one, on one thread and on torch's
    current number; None where torch has no such kernel, or no padding makes it invariant."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 256, generator=generator)
    x = torch.randn(FBGEMM_PROBE_ROWS, 256, generator=generator)
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        full = torch.ops.quantized.linear_dynamic_fp16(x, packed)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one_thread = torch.ops.quantized.linear_dynamic_fp16(x, packed)
        finally:
            torch.set_num_threads(threads)
    except (RuntimeError, AttributeError):
        return None
    if not torch.equal(full, one_thread) or not torch.allclose(full, x @ weight.half().float().t(), atol=1e-4):
        return None
    exact = [True] + [
        torch.equal(torch.ops.quantized.linear_dynamic_fp16(x[:rows], packed), full[:rows])
        for rows in range(1, FBGEMM_PROBE_ROWS + 1)
    ]
    multiple = next((m for m in (1, 2, 3, 4, 6, 8, 12) if all(exact[m::m])), None)
    if multiple is None:
        return None
    table = list(range(FBGEMM_PROBE_ROWS + 1))  # each count padded to the next exact one (the full batch is)
    for rows in range(FBGEMM_PROBE_ROWS - 1, 0, -1):
        if not exact[rows]:
            table[rows] = table[rows + 1]
    return RowPadding(tuple(table), multiple)


def fbgemm_float16_available() -> bool:
    """True when ``--quantization float16`` runs on FBGEMM's float16-weight GEMM here (x86 builds)."""
    return fbgemm_float16_padding() is not None


def auto_weight_format(device: torch.device, dtype: str = "auto") -> str:
    """What ``--quantization auto`` serves a GGUF file with Q4_0/Q4_1/Q8_0 weights in, on ``device`` with
    ``--dtype dtype``: ``native`` on CUDA (for the kinds ``native_weight_kinds`` keeps there); on a CPU torch
    runs at AVX-512, ``native`` too, where attention gives a row the same bits whatever its company
    (``attention_is_width_invariant``, probed at start-up); else ``float16`` where torch has FBGEMM (x86; it
    computes in float32, so only under ``--dtype auto`` or ``float32``), ``native`` at AVX-512 and ``none``
    elsewhere.

    ``native`` rounds its GEMMs' inputs to bfloat16, which turns any last-bit difference upstream into a
    different input now and then, and a different token after it: it is the default only where the engine
    keeps every row's bits independent of its batch and chunking (the int4 kernel computes each row alone;
    attention needs the probe). There it decodes one stream faster than ``float16`` in less memory; long
    prompts and large batches run as fast or slower (docs/engine.md).
    """
    if device.type == "cuda":
        return "native"
    if device.type == "cpu" and fast_weight_only_kernels(device) and attention_is_width_invariant("cpu"):
        return "native"
    if device.type == "cpu" and dtype in ("auto", "float32") and fbgemm_float16_available():
        return "float16"
    return "native" if fast_weight_only_kernels(device) else "none"


def quantized_compute_dtype(device: torch.device) -> torch.dtype:
    """Activations' dtype on the ``native`` path under ``--dtype auto``: bfloat16 on CUDA, float32 on a CPU
    (where the int4/int8 GEMMs take their inputs in ``weight_only_input_dtype``)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def weight_only_input_dtype(device: torch.device) -> torch.dtype:
    """The dtype the ``native`` path's int4/int8 GEMMs take their inputs in under ``--dtype auto``.

    On a CPU, bfloat16 whatever the activations are kept in: torch's CPU kernels are an order of magnitude or
    more slower with float32 inputs than with bfloat16 ones, while the norms, attention and residual stream
    stay in float32. On CUDA, the compute dtype (bfloat16).
    """
    return torch.bfloat16 if device.type == "cpu" else quantized_compute_dtype(device)


class Int4Linear(nn.Module):
    """``y = x @ w.T (+ bias)`` with ``w`` as packed 4-bit codes and per-``group_size`` scales and minimums.

    ``dtype`` is the kernel's: ``x`` is rounded to it and the product returned in ``x``'s dtype; the bias is
    added in its own dtype (the model's).
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self, blocks: QuantizedBlocks, dtype: torch.dtype, device: torch.device, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if blocks.kind not in INT4_KINDS or blocks.minimum is None:
            raise ValueError(f"Int4Linear takes Q4_0/Q4_1 blocks, not {blocks.kind}")
        self.out_features, self.in_features = blocks.codes.shape
        self.group_size = QUANT_GROUP
        codes = torch.from_numpy(np.ascontiguousarray(blocks.codes))
        scale = torch.from_numpy(blocks.scale)
        # torch's kernels compute (q - 8) * scale + zero: the file's w = d * q + m is zero = m + 8 d
        zero = torch.from_numpy(blocks.minimum) + 8.0 * scale
        self.register_buffer("packed", pack_int4(codes, device))
        sz = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()  # [groups, out_features, 2]
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = (x if x.dim() == 2 else x.reshape(-1, self.in_features)).to(self.scales_and_zeros.dtype)
        if flat.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        out = (out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)).to(x.dtype)
        return out if self.bias is None else out + self.bias

    @classmethod
    def concatenate(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """One layer computing ``parts`` side by side (their outputs concatenated), with the same results: the
        kernel computes each output from its own row of codes and scales. None unless every part is on the CPU
        (whose packed layout keeps a row per output) with the same input size, dtype and bias or no bias."""
        first = parts[0]
        if any(
            p.packed.device.type != "cpu"
            or p.in_features != first.in_features
            or p.scales_and_zeros.dtype != first.scales_and_zeros.dtype
            or (p.bias is None) != (first.bias is None)
            for p in parts
        ):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.out_features, fused.in_features = sum(p.out_features for p in parts), first.in_features
        fused.group_size = first.group_size
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))
        fused.register_buffer("scales_and_zeros", torch.cat([p.scales_and_zeros for p in parts], dim=1))
        biases: list[torch.Tensor] = [p.bias.detach() for p in parts if p.bias is not None]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if biases else None
        return fused


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """4-bit codes ``[N, K]`` (0..15) in the layout of the device's int4 GEMM."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    codes = codes.to(device=device, dtype=torch.uint8)
    pairs = (codes[:, ::2] << 4) | codes[:, 1::2]
    inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0 or t == 2)  # K = 576: 4
    return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)


class Int8Weight(nn.Module):
    """An int8 matrix with one scale per row: the weight of an ``Int8Linear``, and a tied embedding's table."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @classmethod
    def from_blocks(cls, blocks: QuantizedBlocks, dtype: torch.dtype, device: torch.device) -> Int8Weight:
        """A GGUF file's Q8_0 blocks with one scale per row, re-derived from the per-32 ones; scales in ``dtype``."""
        if blocks.kind not in INT8_KINDS:
            raise ValueError(f"Int8Weight takes Q8_0 blocks, not {blocks.kind}")
        weight = torch.from_numpy(blocks.dequantize())
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes.to(device), scales.to(device=device, dtype=dtype))

    @classmethod
    def concatenate(cls, parts: list[Int8Weight]) -> Int8Weight:
        """The rows of ``parts`` one after another, in one matrix."""
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


class Int8Linear(nn.Module):
    """``y = x @ w.T (+ bias)`` over an ``Int8Weight``.

    ``x`` is rounded to the weight's dtype and the product returned in ``x``'s; the bias is added in its own
    dtype. ``float32_output``: compute in float32 whatever the weight's dtype, and return float32. For the
    output projection: bfloat16 logits (a step of 0.125 at 25) tie the top tokens of a confident model.
    """

    scales_float32: torch.Tensor | None

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None, float32_output: bool = False) -> None:
        super().__init__()
        self.weight_int8 = weight
        self.out_features, self.in_features = weight.codes.shape
        dtype, device = weight.scales.dtype, weight.scales.device
        self.float32_output = float32_output
        self.compute_dtype = torch.float32 if float32_output else dtype
        scales = weight.scales.float() if float32_output and dtype != torch.float32 else None
        self.register_buffer("scales_float32", scales)
        self.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_int8
        scales = w.scales if self.scales_float32 is None else self.scales_float32
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        out = torch.ops.aten._weight_int8pack_mm(flat, w.codes, scales).view(*x.shape[:-1], self.out_features)
        if not self.float32_output:
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    @classmethod
    def concatenate(cls, parts: list[Int8Linear]) -> Int8Linear | None:
        """One layer computing ``parts`` side by side (their outputs concatenated), with the same results (one
        scale per output row); None unless the parts agree in input size, dtype, output dtype and bias."""
        first = parts[0]
        if any(
            p.in_features != first.in_features
            or p.weight_int8.scales.dtype != first.weight_int8.scales.dtype
            or p.float32_output != first.float32_output
            or (p.bias is None) != (first.bias is None)
            for p in parts
        ):
            return None
        biases: list[torch.Tensor] = [p.bias.detach() for p in parts if p.bias is not None]
        weight = Int8Weight.concatenate([p.weight_int8 for p in parts])
        return cls(weight, torch.cat(biases) if biases else None, first.float32_output)


class Int8Embedding(nn.Module):
    """Rows of an ``Int8Weight`` looked up by token id, scaled back to ``dtype`` (default: the weight's)."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight_int8 = weight
        self.dtype = weight.scales.dtype if dtype is None else dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_int8
        return (w.codes[ids].float() * w.scales[ids].float().unsqueeze(-1)).to(self.dtype)


GEMV_MAX_ROWS = 2  # up to this many rows, torch's float16 matrix-vector kernel beats a float32 GEMM
TILE_BYTES = 1 << 20  # a float32 weight tile of this size stays in cache between its conversion and its GEMM


class TileScratch:
    """One float32 buffer, shared by a model's ``Float16Linear`` layers, that each converts its weight tiles
    into: a fresh multi-MiB tensor per call would cost page faults. Not thread-safe (one engine, one thread)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def get(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        if self._buffer.numel() < rows * cols or self._buffer.device != device:
            self._buffer = torch.empty(rows * cols, dtype=torch.float32, device=device)
        return self._buffer[: rows * cols].view(rows, cols)


class Float16Linear(nn.Module):
    """``y = x @ w.T (+ bias)`` with ``w`` stored in float16, ``x`` and ``y`` in float32.

    Where torch has FBGEMM (x86), one kernel does every batch size: ``w`` packed in float16, converted to
    float32 in registers, float32 accumulation; the batch is padded with zero rows to a size whose blocks all
    sum in the same order (``fbgemm_float16_padding``), so a row's result is the same in any batch.
    Elsewhere both paths compute ``dot(fp16(x), w)`` with float32 accumulation: one or two rows by the float16
    matrix-vector kernel, more by tiles of ``w`` converted to float32; the result is rounded to float16 (as the
    matrix-vector kernel returns it) unless ``float32_output``, which always takes the tiled path.
    ``y`` is returned in ``x``'s dtype, or in float32 under ``float32_output`` (an output projection's logits).
    """

    weight: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scratch: TileScratch,
        float32_output: bool = False,
        use_fbgemm: bool | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.float32_output = float32_output
        padding = fbgemm_float16_padding() if use_fbgemm is not False and weight.device.type == "cpu" else None
        if use_fbgemm and padding is None:
            raise ValueError("FBGEMM's float16 GEMM is not available (or not batch-invariant) here")
        self.padding = padding
        self.use_fbgemm = padding is not None
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        if self.use_fbgemm:  # the packed copy is the only one (a tied table's owner keeps its own)
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), self.bias)
            self.packed_bytes = 2 * weight.numel()
            self.weight = None
            return
        self.register_buffer("weight", weight.to(torch.float16).contiguous())
        self.scratch = scratch
        self.tile_rows = max(1, TILE_BYTES // (4 * self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.padding is not None:
            rows = flat.shape[0]
            padded = self.padding.rows_for(rows)
            flat = flat.float()
            flat = F.pad(flat, (0, 0, 0, padded - rows)) if padded > rows else flat.contiguous()
            out = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)[:rows].view(*x.shape[:-1], -1)
            return out if self.float32_output else out.to(x.dtype)
        assert self.weight is not None
        if flat.shape[0] <= GEMV_MAX_ROWS and not self.float32_output:
            out = F.linear(flat.to(torch.float16), self.weight).float()
        else:
            out = self._tiled(flat.to(torch.float16).float())
            if not self.float32_output:
                out = out.to(torch.float16).float()
        if self.bias is not None:
            out = out + self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.float32_output else out.to(x.dtype)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for lo in range(0, self.out_features, self.tile_rows):
            hi = min(lo + self.tile_rows, self.out_features)
            tile = self.scratch.get(hi - lo, self.in_features, x.device)
            tile.copy_(self.weight[lo:hi])
            out[:, lo:hi] = torch.mm(x, tile.t())
        return out


class Float16Embedding(nn.Module):
    """Rows of a float16 table (shared with a tied ``Float16Linear``), returned in float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()


def store_weights_in_float16(module: nn.Module) -> None:
    """Replace ``module``'s linears by ``Float16Linear`` and its embedding by a ``Float16Embedding`` (a tied
    output projection shares the embedding's float16 table); the float32 weights, and the memory-mapped
    checkpoint they came from, are released."""
    scratch = TileScratch()
    embeddings = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, nn.Embedding)]
    tables: dict[int, torch.Tensor] = {}
    for name, embedding in embeddings:
        table = embedding.weight.detach().to(torch.float16)
        tables[embedding.weight.data_ptr()] = table
        module.set_submodule(name, Float16Embedding(table))
    for name, linear in [(n, s) for n, s in module.named_modules() if isinstance(s, nn.Linear)]:
        shared = tables.get(linear.weight.data_ptr())
        weight = shared if shared is not None else linear.weight.detach()
        replacement = Float16Linear(weight, linear.bias, scratch, float32_output=name.endswith("lm_head"))
        if shared is not None:
            replacement.weight = shared  # one table for the embedding and the output projection
        module.set_submodule(name, replacement)
    with torch.no_grad():  # the norms' weights: own copies, so the checkpoint file's mapping (all read) is released
        for param in module.parameters():
            param.data = param.data.clone()


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere): building a
    model in one format and converting it to another leaves hundreds of MB free but resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (shared ones once): what a decode step streams, at most."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total + sum(getattr(sub, "packed_bytes", 0) for sub in module.modules())  # FBGEMM's packed weights
