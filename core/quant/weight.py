"""`QuantWeight`: one linear layer's quantized weight in portside's canonical layout, whatever
checkpoint format it came from, and its pure-torch reference (dequantize, then matmul).

Canonical layouts (the logical weight is ``W [.., N, K]``, N output and K input features; a
leading expert dimension is allowed):

- ``kind == "int"`` (GPTQ, AWQ, compressed-tensors int, ``--quantization int8``):
  ``qweight`` uint8, unsigned codes: ``[.., N, K]`` for 8 bits, ``[.., N, K // 2]`` for 4 bits
  (input column 2j in the low nibble of byte j, 2j + 1 in the high one); ``scales`` fp32
  ``[.., N, G]``; ``zeros`` fp32 ``[.., N, G]`` (whole numbers, in code units) or None
  (symmetric: zero = 2^(bits-1));
  ``g_idx`` int32 ``[.., K]`` (the group of each input column) or None (column k is in group
  ``k // group_size``). ``W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]``.
- ``kind == "fp8"``: ``qweight`` float8_e4m3fn ``[.., N, K]``, ``scales`` fp32 ``[.., N, 1]``
  (a per-tensor scale is stored per channel). ``W = q * scale``. Block-wise (``block = (bn,
  bk)``: DeepSeek-V3, transformers' FineGrainedFP8): ``scales`` fp32 ``[.., ceil(N / bn),
  ceil(K / bk)]`` as the checkpoint's ``weight_scale_inv``, ``W[n, k] = q[n, k] *
  scale[n // bn, k // bk]``.
- ``kind == "mxfp4"`` (OCP microscaling FP4, gpt-oss experts): ``qweight`` uint8 ``[.., N, K // 2]``,
  two e2m1 codes a byte (column 2j in the low nibble of byte j, as int4), ``scales`` uint8
  ``[.., N, K // 32]`` e8m0 exponents: ``W[n, k] = FP4_VALUES[code] * 2^(scale[n, k // 32] - 127)``.
- ``kind == "gguf"``: ``qweight`` uint8 ``[.., N, row_bytes]``, each row llama.cpp's blocks of
  type ``ggml_type`` (`portside.quant.gguf`).

``act`` says how activations are treated: None (weight-only: the matmul runs in the
activation's dtype) or ``"int8"`` / ``"fp8"`` (quantized per token before the matmul, with a
scale from the token's absolute maximum, or ``input_scale`` where the checkpoint calibrated one;
``act_group`` > 0: a scale per token and group of that many columns).

A platform may re-lay the tensors for its kernel in `ModelOps.prepare_quantized`, storing what it
needs as further buffers (``packed_*``) or attributes; the canonical tensors it keeps stay valid
so the reference can always run.

A fused layer (q/k/v, gate/up) whose parts' act orders differ is a `QuantParts`: one
`QuantWeight` per part, multiplied one after the other and concatenated along N (a single
``g_idx`` over K cannot group rows that the checkpoint grouped differently).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from portside.quant.gguf_blocks import dequantize_blocks

__all__ = ["QuantWeight", "QuantParts", "dequantize", "dequantize_fp8_block", "dequantize_mxfp4", "expand_block_scales", "FP4_VALUES", "quantize_per_channel", "quantize_activation", "quantized_linear", "quantized_embedding", "FP8_MAX"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
KINDS = ("int", "fp8", "gguf", "mxfp4")
# e2m1 (OCP MX FP4): sign bit 3, then 2 exponent and 1 mantissa bits
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ACTS = (None, "int8", "fp8")


class QuantWeight(nn.Module):
    """The tensors are buffers, so the module tree moves, counts and packs them with the rest."""

    qweight: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(
        self,
        kind: str,
        shape: tuple[int, int],
        qweight: torch.Tensor,
        *,
        bits: int = 8,
        scales: torch.Tensor | None = None,
        zeros: torch.Tensor | None = None,
        group_size: int | None = None,
        g_idx: torch.Tensor | None = None,
        ggml_type: int | None = None,
        act: str | None = None,
        input_scale: torch.Tensor | None = None,
        method: str = "",
        block: tuple[int, int] | None = None,
        act_group: int = 0,
    ) -> None:
        super().__init__()
        if kind not in KINDS or act not in ACTS:
            raise ValueError(f"quantized weight kind {kind!r} / activations {act!r} unknown")
        self.kind, self.shape, self.bits, self.act, self.method = kind, tuple(shape), bits, act, method
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.act_group = act_group  # > 0: activations rounded per token and act_group columns
        self.group_size = group_size or shape[1]
        self.ggml_type = ggml_type
        self.register_buffer("qweight", qweight)
        for name, t in (("scales", scales), ("zeros", zeros), ("g_idx", g_idx), ("input_scale", input_scale)):
            self.register_buffer(name, t)
        self.layout: Any = None  # what a platform's prepare_quantized records about its own buffers

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def expert(self, e: int) -> QuantWeight:
        """Expert e's weight of a stacked [E, N, ...] one, sharing storage: every buffer with the
        leading expert axis is sliced, a platform's own ones (`ModelOps.prepare_quantized` of a
        stacked weight keeps the expert axis first) included; ``layout`` is carried over."""
        view = QuantWeight(self.kind, (self.shape[0], self.shape[1]), self.qweight[e], bits=self.bits, group_size=self.group_size,
                           ggml_type=self.ggml_type, act=self.act, method=self.method, block=self.block,
                           act_group=self.act_group)
        experts = self.qweight.shape[0]
        for name, t in self._buffers.items():
            if name != "qweight":
                stacked = t is not None and t.dim() > 0 and t.shape[0] == experts and name != "input_scale"
                view.register_buffer(name, t[e] if stacked and t is not None else t)
        view.layout = self.layout
        return view

    def extra_repr(self) -> str:
        what = {"gguf": f"gguf type {self.ggml_type}", "mxfp4": "mxfp4", "fp8": "fp8"}.get(self.kind, f"{self.kind}{self.bits}")
        if self.block is not None:
            what += f" {self.block[0]}x{self.block[1]} blocks"
        return f"{self.method or what}, {what}, shape={self.shape}, group_size={self.group_size}, act={self.act}"


class QuantParts(nn.ModuleList):
    """A fused weight kept as its parts: `QuantWeight`s over consecutive output rows, in output
    order (each prepared by the platform on its own). `LinearBase` and
    `ModelOps.quantized_moe_experts` multiply by each part and concatenate the products."""

    def weights(self) -> list[QuantWeight]:
        return cast(list[QuantWeight], list(self))

    @property
    def out_features(self) -> int:
        return sum(w.out_features for w in self.weights())

    @property
    def in_features(self) -> int:
        return self.weights()[0].in_features


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K // 2] -> uint8 [.., K] (low nibble first)."""
    return torch.stack((packed & 0xF, (packed >> 4) & 0xF), dim=-1).flatten(-2)  # the mask: XLA shifts uint8 as signed


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [.., K] in [0, 16) -> [.., K // 2] (`unpack_int4`'s inverse)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _group_index(w: QuantWeight, device: torch.device) -> torch.Tensor:
    if w.g_idx is not None:
        return w.g_idx.long()
    return torch.arange(w.in_features, device=device) // w.group_size


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight [.., N, K] in `dtype` (computed in fp32)."""
    if w.kind == "gguf":
        assert w.ggml_type is not None
        return dequantize_blocks(w.qweight, w.ggml_type, w.in_features).to(dtype)
    assert w.scales is not None
    if w.kind == "mxfp4":
        return dequantize_mxfp4(w.qweight, w.scales, dtype)
    if w.kind == "fp8":
        if w.block is not None:
            return dequantize_fp8_block(w.qweight, w.scales, w.block, dtype)
        return (w.qweight.float() * w.scales).to(dtype)
    q = unpack_int4(w.qweight) if w.bits == 4 else w.qweight
    g = _group_index(w, q.device)
    scale = w.scales.index_select(-1, g)  # [.., N, K]
    zero = w.zeros.index_select(-1, g).float() if w.zeros is not None else float(1 << (w.bits - 1))
    return ((q.float() - zero) * scale).to(dtype)


def expand_block_scales(scales: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales [.., ceil(N / bn), ceil(K / bk)] -> one per weight element [.., N, K]."""
    return scales.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_fp8_block(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Block-wise fp8 [.., N, K] times its blocks' scales, in `dtype` (computed in fp32)."""
    n, k = q.shape[-2], q.shape[-1]
    bn, bk = block
    if n % bn or k % bk:  # partial edge blocks: a scale per element
        return (q.float() * expand_block_scales(scales.float(), block, n, k)).to(dtype)
    tiles = q.float().unflatten(-1, (k // bk, bk)).unflatten(-3, (n // bn, bn))  # [.., N/bn, bn, K/bk, bk]
    return (tiles * scales.float()[..., :, None, :, None]).flatten(-4, -3).flatten(-2).to(dtype)


def mxfp4_byte_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """[256, 2] fp32: the e2m1 values of a byte's low and high nibble."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    b = torch.arange(256, device=device)
    return torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1)


def dequantize_mxfp4(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 codes [.., N, K / 2] and e8m0 scales [.., N, K / 32] -> [.., N, K] in `dtype`
    (exact in fp32: an e2m1 value times a power of two)."""
    values = mxfp4_byte_values(q.device)[q.int()].flatten(-2)  # [.., N, K]: each byte's low nibble first
    powers = torch.exp2(scales.float() - 127).unsqueeze(-1)  # [.., N, K / 32, 1]
    return (values.unflatten(-1, (-1, 32)) * powers).flatten(-2).to(dtype)


def quantize_activation(x: torch.Tensor, mode: str, input_scale: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """x [T, K] rounded the way an int8 or fp8 kernel sees it (per-token scale, or the static
    `input_scale`; `group` > 0: a scale per token and `group` consecutive columns, as
    DeepSeek-V3's kernels and compressed-tensors' FP8_BLOCK scheme), returned dequantized in x's
    dtype: the reference of a W8A8 matmul."""
    if group > 0 and input_scale is None:
        if x.shape[-1] % group:
            raise ValueError(f"{x.shape[-1]} activation columns are not whole groups of {group}")
        return quantize_activation(x.unflatten(-1, (-1, group)), mode).flatten(-2)
    xf = x.float()
    qmax = 127.0 if mode == "int8" else FP8_MAX
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    q = (xf / scale).clamp(-qmax, qmax)
    q = q.round() if mode == "int8" else q.to(torch.float8_e4m3fn).float()
    return (q * scale).to(x.dtype)


def quantized_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: y [T, N] = act(x) [T, K] @ dequantize(w)^T + bias, in x's dtype."""
    if w.act is not None:
        x = quantize_activation(x, w.act, w.input_scale, w.act_group)
    return F.linear(x, dequantize(w, x.dtype), bias)


def quantized_embedding(ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized (fp32): only the rows looked up."""
    rows = QuantWeight(
        w.kind, (ids.numel(), w.in_features), w.qweight.index_select(0, ids), bits=w.bits,
        scales=None if w.scales is None else w.scales.index_select(0, ids),
        zeros=None if w.zeros is None else w.zeros.index_select(0, ids), group_size=w.group_size, g_idx=w.g_idx,
        ggml_type=w.ggml_type,
    )
    return dequantize(rows)


def quantize_per_channel(w: torch.Tensor, method: str, act: str | None = None) -> QuantWeight:
    """A dense weight [.., N, K] quantized symmetrically per output channel to int8 or fp8
    (``--quantization int8|fp8``)."""
    w = w.float()
    qmax = FP8_MAX if method == "fp8" else 127.0
    scale = (w.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    shape = (w.shape[-2], w.shape[-1])
    if method == "fp8":
        return QuantWeight("fp8", shape, (w / scale).to(torch.float8_e4m3fn), scales=scale, act=act, method="fp8")
    q = ((w / scale).round().clamp(-127, 127).to(torch.int16) + 128).to(torch.uint8)
    return QuantWeight("int", shape, q, bits=8, scales=scale, act=act, method="int8")
