"""The cpu backend's quantized linears: `CpuQuantOps`, the `ModelOps` mixin that `moe.CpuModelOps`
inherits, over the native operators of `csrc/quant_gemm.cpp`:

- ``portside_cpu_native::quant_linear``: weight-only, the codes decoded to fp32 in registers
  (x fp32 or bf16, computed in fp32): int8 and int4 in portside's canonical layout (per channel or
  grouped, with or without zero points), fp8 e4m3, and GGUF Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K
  blocks as llama.cpp stores them;
- ``portside_cpu_native::gguf_dot`` (`gguf_dot`): GGUF Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K / IQ4_XS
  blocks times activations quantized to int8 per block as the kernel goes, as llama.cpp does
  (``gguf_act == "int8"``: backend option ``cpu_gguf_act``; its default ``fp32``: the weight-only
  kernel above, IQ4_XS the reference);
- ``portside_cpu_native::int4_dot`` (`int4_dot`): weight-only int4 (GPTQ/AWQ) times activations
  quantized to int8 per block as the kernel goes (layout ``w4a8``: backend option
  ``cpu_int4_act=int8``; its default ``fp32``: the weight-only kernel above);
- ``portside_cpu_native::quant_linear_w8a8``: int8 weights x int8 activations (``act ==
  "int8"``, ``--quantized-activations int8``; weight-only int8 with backend option
  ``cpu_int8_act=int8``): the activations rounded per token as
  `portside.quant.weight.quantize_activation` does, exact integer dot products (AVX2
  maddubs, AVX512-VNNI dpbusd, AMX-INT8 tiles where the build has them and the kernel grants
  the tile state), scaled in fp32.

`prepare_quantized` decides once per layer (`plan`) and records it as ``weight.layout`` (a
`CpuQuantLayout`); act-order weights (``g_idx`` not ``k // group_size``) get a copy of their codes
with the input columns sorted by group (``packed_qweight``) and the order (``packed_perm``): x is
gathered by it per call. The canonical buffers stay as loaded, so the reference still runs on the
weight. Layers the kernels do not cover (other formats or shapes, no AVX2/FMA/F16C, no C++
compiler) keep the reference (``super()``), as does a call it was not written for (x not 2-D, not
fp32/bf16). Block-scaled weights (block-wise fp8, mxfp4) go to `block_quant`. fp8 activations
(``act == "fp8"``), and int8 activations of non-int8 weights, are
rounded in torch first exactly as the reference does, then multiplied by the weight-only kernel.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from portside.backends.cpu import block_quant, gguf_dot, int4_dot, native_ops
from portside.contract import QuantWeight, pack_int4, quantize_activation, unpack_int4

logger = logging.getLogger(__name__)

FMT_INT8, FMT_INT4, FMT_FP8, FMT_GGUF = 0, 1, 2, 100  # csrc/quant_gemm.cpp's Fmt
# ggml types with a native kernel -> (name, elements per block)
GGUF_KERNELS = {8: ("Q8_0", 32), 2: ("Q4_0", 32), 12: ("Q4_K", 256), 13: ("Q5_K", 256), 14: ("Q6_K", 256)}
X_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CpuQuantLayout:
    """What `CpuQuantOps.prepare_quantized` chose for one weight (``weight.layout``)."""

    kernel: str  # "int8", "int4", "fp8", "w8a8", "w4a8" (`int4_dot`), "gguf-<type>" or "gguf-<type>-int8" (`gguf_dot`)
    fmt: int  # csrc/quant_gemm.cpp's format code (unused for "w8a8")
    group_size: int  # columns per scale group (0: the whole row)
    permuted: bool  # act order: codes in ``packed_qweight``, x gathered by ``packed_perm``


@functools.lru_cache(maxsize=1)
def isa() -> str:
    """The instruction-set paths the native library compiled in ("" without AVX2/FMA/F16C or
    without the library): e.g. "avx2", "avx2,avx512vnni,amx"."""
    if native_ops.unavailable_reason() is not None:
        return ""
    return str(torch.ops.portside_cpu_native.quant_isa())


def plan(w: QuantWeight, gguf_act: str = "fp32", int4_act: str = "fp32", int8_act: str = "fp32") -> tuple[CpuQuantLayout | None, str]:
    """The native layout for `w` (a linear's 2-D weight or stacked experts' 3-D one), or None and
    why the reference stays; `gguf_act` "int8": GGUF types with an int8-activation kernel take it;
    `int4_act` "int8": weight-only int4 takes `int4_dot` ("w4a8"); `int8_act` "int8": weight-only
    int8 takes the W8A8 kernel (activations rounded per token as the kernel goes)."""
    n, k = w.shape
    if w.qweight.dim() not in (2, 3) or w.qweight.device.type != "cpu":
        return None, f"qweight of shape {tuple(w.qweight.shape)} on {w.qweight.device}"
    if k % 32:
        return None, f"{k} input features (the kernels take multiples of 32)"
    if w.kind == "gguf":
        if gguf_act == "int8" and w.ggml_type in gguf_dot.TYPES:
            name = gguf_dot.TYPES[w.ggml_type]
            block = 32 if name in ("Q8_0", "Q4_0") else 256
            if k % block:
                return None, f"{k} input features are not whole {name} blocks"
            return CpuQuantLayout(f"gguf-{name}-int8", FMT_GGUF + w.ggml_type, 0, False), ""
        if w.ggml_type not in GGUF_KERNELS:
            return None, f"GGUF type {w.ggml_type} has no cpu kernel (native: {', '.join(t for t, _ in GGUF_KERNELS.values())})"
        name, block = GGUF_KERNELS[w.ggml_type]
        if k % block:
            return None, f"{k} input features are not whole {name} blocks"
        return CpuQuantLayout(f"gguf-{name}", FMT_GGUF + w.ggml_type, 0, False), ""
    if w.kind == "fp8":
        if w.scales is None or w.scales.shape[-1] != 1:
            return None, "fp8 scales not per output channel"
        return CpuQuantLayout("fp8", FMT_FP8, 0, False), ""
    if w.bits not in (4, 8) or w.scales is None:
        return None, f"int{w.bits} weights"
    groups = w.scales.shape[-1]
    gs = k // groups
    if gs * groups != k or gs % 32:
        return None, f"group size {k}/{groups} (the kernels take multiples of 32)"
    permuted = False
    if w.g_idx is not None:
        if w.g_idx.dim() != 1:
            return None, "per-expert g_idx"
        natural = torch.arange(k, device=w.g_idx.device) // gs
        if not torch.equal(w.g_idx.long(), natural):
            if not torch.equal(torch.sort(w.g_idx.long()).values, natural):
                return None, "act-order groups of unequal sizes"
            permuted = True
    if w.bits == 8 and (w.act == "int8" or (int8_act == "int8" and w.act is None)):
        return CpuQuantLayout("w8a8", FMT_INT8, gs, permuted), ""
    if int4_act == "int8" and w.bits == 4 and w.act is None:
        return CpuQuantLayout("w4a8", FMT_INT4, gs, permuted), ""
    return CpuQuantLayout(f"int{w.bits}", FMT_INT8 if w.bits == 8 else FMT_INT4, gs, permuted), ""


def _permute_codes(w: QuantWeight, perm: torch.Tensor) -> torch.Tensor:
    """The codes with their input columns in `perm`'s order (int4: unpacked, gathered, repacked)."""
    if w.bits == 4:
        return pack_int4(unpack_int4(w.qweight).index_select(-1, perm)).contiguous()
    return w.qweight.index_select(-1, perm).contiguous()


class CpuQuantOps:
    """`ModelOps` mixin: `prepare_quantized` / `quantized_linear` (and the experts' per-expert
    linear) over the native kernels, ``super()`` for what they do not cover. The class mixing it
    in sets ``native`` (the operator library builds)."""

    native: bool = False
    gguf_act: str = gguf_dot.DEFAULT_GGUF_ACT  # backend option cpu_gguf_act (the platform sets it)
    int4_act: str = int4_dot.DEFAULT_INT4_ACT  # backend option cpu_int4_act (the platform sets it)
    int8_act: str = int4_dot.DEFAULT_INT4_ACT  # backend option cpu_int8_act (the platform sets it)

    def prepare_quantized(self, weight: QuantWeight) -> QuantWeight:
        weight = super().prepare_quantized(weight)  # type: ignore[misc]
        if block_quant.is_block_scaled(weight):  # block-wise fp8, mxfp4: native, else tiled torch
            return block_quant.prepare(weight, self.native)
        if not self.native or not isa():
            return weight
        layout, why = plan(weight, self.gguf_act, self.int4_act, self.int8_act)
        if layout is None:
            logger.info("cpu: %s stays on the reference quantized linear: %s", weight.extra_repr(), why)
            return weight
        if weight.kind == "int":
            if weight.scales.dtype != torch.float32 or not weight.scales.is_contiguous():
                weight.register_buffer("packed_scales", weight.scales.float().contiguous())
            if weight.zeros is not None:
                weight.register_buffer("packed_zeros", weight.zeros.float().contiguous())
            if layout.permuted:
                perm = torch.argsort(weight.g_idx.long(), stable=True)
                weight.register_buffer("packed_perm", perm)
                weight.register_buffer("packed_qweight", _permute_codes(weight, perm))
        elif weight.kind == "fp8" and (weight.scales.dtype != torch.float32 or not weight.scales.is_contiguous()):
            weight.register_buffer("packed_scales", weight.scales.float().contiguous())
        if not weight.qweight.is_contiguous():
            weight.qweight = weight.qweight.contiguous()
        weight.layout = layout
        return weight

    def quantized_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        layout = weight.layout
        if isinstance(layout, block_quant.BlockLayout) and weight.qweight.dim() == 2 and x.dim() == 2:
            return block_quant.linear(x, weight, weight.qweight, weight.scales, bias)
        if not isinstance(layout, CpuQuantLayout) or weight.qweight.dim() != 2 or x.dim() != 2 or x.dtype not in X_DTYPES:
            return super().quantized_linear(x, weight, bias)  # type: ignore[misc]
        return _linear(x, weight, layout, weight.qweight, _scales(weight), _zeros(weight), bias)

    def _expert_linear(self, x: torch.Tensor, w: QuantWeight, e: int) -> torch.Tensor:
        """Expert e of stacked quantized experts: the kernel over its slice (no new QuantWeight)."""
        layout = w.layout
        if isinstance(layout, block_quant.BlockLayout) and w.qweight.dim() == 3 and x.dim() == 2:
            return block_quant.linear(x, w, w.qweight[e], w.scales[e], None)
        if not isinstance(layout, CpuQuantLayout) or w.qweight.dim() != 3 or x.dim() != 2 or x.dtype not in X_DTYPES or layout.permuted:
            return super()._expert_linear(x, w, e)  # type: ignore[misc]
        scales, zeros = _scales(w), _zeros(w)
        return _linear(x, w, layout, w.qweight[e], None if scales is None else scales[e],
                       None if zeros is None else zeros[e], None)


def _scales(w: QuantWeight) -> torch.Tensor | None:
    packed = getattr(w, "packed_scales", None)
    return w.scales if packed is None else packed


def _zeros(w: QuantWeight) -> torch.Tensor | None:
    return getattr(w, "packed_zeros", None)


def _linear(x: torch.Tensor, w: QuantWeight, layout: CpuQuantLayout, codes: torch.Tensor, scales: torch.Tensor | None,
            zeros: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    ops = torch.ops.portside_cpu_native
    if layout.permuted:
        x = x.index_select(1, w.packed_perm)
        codes = w.packed_qweight
    if layout.kernel.endswith("-int8"):  # GGUF x int8 activations
        return gguf_dot.linear(x, codes, w.ggml_type, bias)
    if layout.kernel == "w4a8":  # int4 x int8 activations
        assert scales is not None
        return int4_dot.linear(x, codes, scales, zeros, layout.group_size, bias)
    if layout.kernel == "w8a8":
        return ops.quant_linear_w8a8(x, codes, scales, zeros, w.input_scale, bias, layout.group_size)
    if w.act is not None:  # rounded as the reference rounds them, then the weight-only kernel
        x = quantize_activation(x, w.act, w.input_scale)
    return ops.quant_linear(x, codes, scales, zeros, bias, layout.fmt, layout.group_size)
