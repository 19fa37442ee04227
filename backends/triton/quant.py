"""Quantized linear layers on cuda and rocm: Triton kernels that read `QuantWeight`'s canonical
layouts (`portside.quant.weight`) as they are, and the `ModelOps` overrides that launch them.

Two paths, chosen per weight by `quant_path` (recorded in ``weight.layout`` at prepare time):

- ``"dequant"``, weight-only (GPTQ, AWQ, compressed-tensors W4A16 / W8A16, ``--quantization int8``,
  FP8 weights with ``act`` None, block-wise FP8 (DeepSeek-V3; compressed-tensors FP8_BLOCK with its
  activations first rounded per token group in torch, as the reference), MXFP4 (gpt-oss experts)): `dequant_gemm.dequant_matmul` dequantizes each weight tile to
  x's dtype in registers and multiplies it, fp32 accumulation;
- ``"scaled_mm"``, W8A8 (``act`` "int8" with symmetric per-channel int8 codes, ``act`` "fp8"
  with FP8 weights and one scale per channel): `scaled_mm.quantize_rows` rounds x per token,
  then `scaled_mm.scaled_matmul` multiplies the codes and applies both scales.

Both GEMMs serve every M with one kernel and a launch table (`launch.choose_quant_launch`):
small M (decode) gets 16-row tiles, wide K steps and split-K (K cut into `split_k` slices whose
fp32 partials are summed in a fixed order: no atomics, the result does not depend on timing);
large M gets 64- or 128-row tiles. What they share is in `quant_gemm`. Nothing is read back to
the host, so a CUDA/HIP graph can capture the calls. The canonical layouts need no re-lay: an
[N, K] row-major weight is the K-contiguous operand `tl.dot` reads fastest, so
`prepare_quantized` only makes the scales and zeros fp32 and contiguous (the layout
`dequantize` already reads) and records the path.

Left to the reference (``super()``): GGUF blocks (llama.cpp's formats), activation roundings the
scaled path does not take (int8 activations with grouped or zero-pointed weights, fp8
activations with integer weights), quantized embeddings, and stacked MoE experts (each expert
routed to goes through `quantized_linear`, so it does reach these kernels). `portside.quant` is
not imported here (backends import only the contract); the weight is duck-typed.

Numerics: fp32 accumulation; int8 products exact in int32. Under the interpreter on CPU tensors
half-precision operands are upcast to fp32 (its bf16 dot is wrong, as in `moe`) and roundings to
bf16 are done in fp32 arithmetic (its fp32 -> bf16 cast truncates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portside.backends.triton.dequant_gemm import dequant_matmul
from portside.backends.triton.launch import ArchInfo, QuantLaunch, choose_quant_launch, detect_arch
from portside.backends.triton.quant_gemm import QuantWeightT, normalized
from portside.backends.triton.scaled_mm import quantize_rows, scaled_matmul
from portside.contract import ModelOps, quantize_activation

__all__ = [
    "QuantLaunch",
    "TritonQuantLayout",
    "TritonQuantOps",
    "choose_quant_launch",
    "dequant_matmul",
    "quant_path",
    "quantize_rows",
    "scaled_matmul",
]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quant_path(w: QuantWeightT) -> str | None:
    """"dequant", "scaled_mm", or None (the reference) for a 2-D `QuantWeight`."""
    if w.kind not in ("int", "fp8", "mxfp4") or w.qweight.dim() != 2 or w.scales is None:
        return None
    if w.kind == "mxfp4":
        return "dequant" if w.qweight.dtype == torch.uint8 and w.scales.dtype == torch.uint8 and w.act is None else None
    if getattr(w, "block", None) is not None:  # block-wise fp8: weight-only, or activations rounded first (FP8_BLOCK)
        ok = w.kind == "fp8" and w.qweight.dtype == torch.float8_e4m3fn and w.input_scale is None
        return "dequant" if ok and w.act in (None, "fp8") else None
    if w.kind == "int" and (w.bits not in (4, 8) or w.qweight.dtype != torch.uint8):
        return None
    if w.kind == "fp8" and w.qweight.dtype != torch.float8_e4m3fn:
        return None
    if w.act is None:
        return "dequant"
    static_ok = w.input_scale is None or w.input_scale.numel() == 1
    per_channel = w.scales.shape[-1] == 1
    if w.act == "int8" and w.kind == "int" and w.bits == 8 and w.zeros is None and w.g_idx is None and per_channel and static_ok:
        return "scaled_mm"
    if w.act == "fp8" and w.kind == "fp8" and per_channel and static_ok:
        return "scaled_mm"
    return None


@dataclass(frozen=True)
class TritonQuantLayout:
    """``QuantWeight.layout`` after `TritonQuantOps.prepare_quantized`: the buffers are the
    canonical ones in the dtypes the kernels read (`quant_gemm.normalized`), and `path` says
    which kernel."""

    path: str  # "dequant" or "scaled_mm"


# --------------------------------------------------------------------------------------------
# ModelOps
# --------------------------------------------------------------------------------------------


class TritonQuantOps(ModelOps):
    """`ModelOps`' quantized-weight methods on the kernels of `dequant_gemm` and `scaled_mm`
    (mixed into `TritonModelOps`); everything else is ``super()``'s reference."""

    _arch: ArchInfo | None = None  # `TritonModelOps` sets it (tests), else detected on first use

    def prepare_quantized(self, weight: QuantWeightT) -> QuantWeightT:
        """Make the buffers the kernels read fp32 / int32 and contiguous in place (still the
        canonical layout, so the reference reads them too) and record the path. Stacked expert
        weights [E, N, ..] are normalized for their per-expert slices."""
        if weight.kind == "gguf":
            return super().prepare_quantized(weight)
        for name, t in normalized(weight).items():
            if t is not None and t is not getattr(weight, name):
                setattr(weight, name, t)
        if weight.qweight.dim() == 2 and (path := quant_path(weight)) is not None:
            weight.layout = TritonQuantLayout(path)
        return weight

    def quantized_linear(self, x: torch.Tensor, weight: QuantWeightT, bias: torch.Tensor | None = None) -> torch.Tensor:
        layout = weight.layout
        path = layout.path if isinstance(layout, TritonQuantLayout) else quant_path(weight)
        if path is None or x.dtype not in KERNEL_DTYPES:
            return super().quantized_linear(x, weight, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return x.new_zeros((*lead, weight.out_features))
        if self._arch is None:
            self._arch = detect_arch(x.device)
        if path == "dequant" and weight.act is not None:  # block-wise fp8 with fp8 activations per token group
            x2 = quantize_activation(x2, weight.act, None, getattr(weight, "act_group", 0))
        y = (scaled_matmul if path == "scaled_mm" else dequant_matmul)(x2, weight, bias, arch=self._arch)
        return y.reshape(*lead, weight.out_features)
