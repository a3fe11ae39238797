"""Weight-only quantized layers: a GGUF file's Q4_0/Q4_1 and Q8_0 weights kept as they ship.

``--quantization`` chooses (``EngineConfig.quantization``):

- ``none``: every weight is dequantised to ``--dtype`` (the exact float path);
- ``native``: Q4_0/Q4_1 weights run as torch's packed int4 weight-only GEMM with the file's per-32 scales
  and minimums (exact: ``w = d * q + m``), Q8_0 ones as int8 weight-only GEMM (one scale per row,
  re-derived from the per-32 ones); other tensors are dequantised to the compute dtype;
- ``auto``: ``native`` for a GGUF file where torch's kernels are fast (CUDA, or a CPU with AVX-512), else
  ``none``. On an AVX2-only CPU torch's int4/int8 weight-only kernels are several times slower than a
  float32 GEMM over the dequantised weights, so keeping the file's format would only save memory.

The compute dtype of the quantized path (``--dtype auto``) is bfloat16 on CUDA and on a CPU with
AVX512-BF16 or AMX, float32 elsewhere. The CUDA kernels (``_convert_weight_to_int4pack``,
``_weight_int4pack_mm``) are called the same way as the CPU ones but have not been run on a GPU yet.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from pdserve.engine.config import QUANTIZATION_MODES
from pdserve.engine.gguf import QUANT_GROUP, QuantizedBlocks

__all__ = ["QUANTIZATION_MODES", "Int4Linear", "Int8Embedding", "Int8Linear", "Int8Weight"]
INT4_KINDS = frozenset({"Q4_0", "Q4_1"})
INT8_KINDS = frozenset({"Q8_0"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bfloat16() -> bool:
    """True when the CPU computes in bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def fast_weight_only_kernels(device: torch.device) -> bool:
    """Whether torch's int4/int8 weight-only GEMMs beat a float GEMM here: CUDA, or a CPU torch runs at AVX-512."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))


def quantized_compute_dtype(device: torch.device) -> torch.dtype:
    """Activations' dtype on the quantized path under ``--dtype auto``."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_bfloat16()):
        return torch.bfloat16
    return torch.float32


class Int4Linear(nn.Module):
    """``y = x @ w.T (+ bias)`` with ``w`` as packed 4-bit codes and per-``group_size`` scales and minimums."""

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
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        if flat.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


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

    def __init__(self, blocks: QuantizedBlocks, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if blocks.kind not in INT8_KINDS:
            raise ValueError(f"Int8Weight takes Q8_0 blocks, not {blocks.kind}")
        weight = torch.from_numpy(blocks.dequantize())
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scales", scales.to(device=device, dtype=dtype))


class Int8Linear(nn.Module):
    """``y = x @ w.T (+ bias)`` over an ``Int8Weight``.

    ``float32_output``: compute in float32 whatever the weight's dtype, and return float32. For the output
    projection: bfloat16 logits (a step of 0.125 at 25) tie the top tokens of a confident model.
    """

    scales_float32: torch.Tensor | None

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None, float32_output: bool = False) -> None:
        super().__init__()
        self.weight_int8 = weight
        self.out_features, self.in_features = weight.codes.shape
        dtype, device = weight.scales.dtype, weight.scales.device
        self.compute_dtype = torch.float32 if float32_output else dtype
        scales = weight.scales.float() if float32_output and dtype != torch.float32 else None
        self.register_buffer("scales_float32", scales)
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_int8
        scales = w.scales if self.scales_float32 is None else self.scales_float32
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        out = torch.ops.aten._weight_int8pack_mm(flat, w.codes, scales)
        if self.bias is not None:
            out = out + self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.compute_dtype == torch.float32 else out.to(x.dtype)


class Int8Embedding(nn.Module):
    """Rows of an ``Int8Weight`` looked up by token id, scaled back to the compute dtype."""

    def __init__(self, weight: Int8Weight) -> None:
        super().__init__()
        self.weight_int8 = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_int8
        return w.codes[ids].to(w.scales.dtype) * w.scales[ids].unsqueeze(-1)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (shared ones once): what a decode step streams, at most."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total
