"""Quantized checkpoints written from a tiny HF folder the way the real tools write them, plus the
oracle: the same model with every quantized weight replaced by its dequantized value, for
transformers to run.

`write_quantized(src, dst, fmt, ...)` quantizes every decoder linear (q/k/v/o, gate/up/down) of
the fp32 folder `src` with an independent round-to-nearest quantizer, packs the codes in `fmt`'s
layout, and writes `dst` (the quantized checkpoint, ``quantization_config`` in config.json) and
``dst/../<name>-oracle`` (dense fp32, the dequantized weights). Formats:

- ``gptq``: AutoGPTQ/GPTQModel v1 packing (qweight [K/pf, N], qzeros = zero - 1 packed along N,
  fp16 scales [G, N], g_idx [K]); ``desc_act`` assigns columns to groups out of order, each
  projection by its own random permutation (``shared_act_order``: q/k/v, gate/up and an expert's
  gate/up share one, the case of projections whose calibration inputs, hence Hessians, are equal);
- ``awq``: AutoAWQ GEMM packing (qweight [K, N/8] in the interleaved nibble order, qzeros, scales);
- ``ct-w4a16`` / ``ct-w8a16``: compressed-tensors ``pack-quantized`` through the library's own
  `pack_to_int32` (weight_packed, weight_scale, weight_zero_point when asymmetric, weight_shape);
- ``ct-w8a8``: compressed-tensors ``int-quantized`` int8 weights, dynamic per-token int8 activations;
- ``ct-fp8``: compressed-tensors ``float-quantized`` FP8 per-channel weights, dynamic per-token FP8
  activations (``static=True``: per-tensor weight scales and a calibrated input_scale);
- ``fp8``: vLLM/AutoFP8's ``quant_method: fp8`` (per-tensor weight_scale, activation_scheme).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["FORMATS", "write_quantized", "quantize_rtn", "gptq_pack", "awq_pack", "oracle_dir"]

FORMATS = ("gptq", "awq", "ct-w4a16", "ct-w8a16", "ct-w8a8", "ct-fp8", "fp8")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # w1-3: Mixtral experts
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0


def oracle_dir(dst: str | Path) -> Path:
    dst = Path(dst)
    return dst.parent / f"{dst.name}-oracle"


def quantize_rtn(
    w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes [N, K] (unsigned, in [0, 2^bits)), fp16-exact scales [N, G] and
    zeros [N, G] (integers, at least `min_zero`: GPTQ v1 stores zero - 1 and cannot hold a zero
    of 0, which AutoGPTQ's own kernels then read as 2^bits) for the column groups `g_idx` [K]."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    qmax = (1 << bits) - 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = cols.abs().amax(1) / ((qmax - 1) / 2)
            z = torch.full((n,), float(1 << (bits - 1)))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / qmax
            z = (-lo / s.half().float()).round().clamp(min_zero, qmax)
        scales[:, g], zeros[:, g] = s.clamp(min=1e-6).half().float(), z
    codes = (w / scales[:, g_idx] + zeros[:, g_idx]).round().clamp(0, qmax).to(torch.int32)
    return codes, scales, zeros


def _pack_rows(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack the last axis 32/bits codes to an int32 word (element i at bits i*bits)."""
    pf = 32 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // pf, pf)
    if order is not None:
        c = c[..., list(order)]  # word nibble i holds column order[i]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (c << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors from codes [N, K], scales and zeros [N, G]."""
    mask = (1 << bits) - 1
    stored_zeros = (zeros.to(torch.int64) - 1) & mask  # v1 convention: zero - 1
    return {
        "qweight": _pack_k(codes, bits),
        "qzeros": _pack_rows(stored_zeros.T.contiguous(), bits),
        "scales": scales.T.contiguous().half(),
    }


def _pack_k(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> GPTQ qweight [K / pf, N]: input columns packed along axis 0."""
    return _pack_rows(codes.contiguous(), bits).T.contiguous()  # [N, K/pf] -> [K/pf, N]


def awq_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors from 4-bit codes [N, K], scales and zeros [N, G]."""
    return {
        "qweight": _pack_rows(codes.T.contiguous(), 4, _AWQ_ORDER),  # [K, N/8]
        "qzeros": _pack_rows(zeros.to(torch.int32).T.contiguous(), 4, _AWQ_ORDER),  # [G, N/8]
        "scales": scales.T.contiguous().half(),
    }


def _ct_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 1 << (bits - 1)
    out = {
        "weight_packed": pack_to_int32((codes - offset).to(torch.int8), bits),
        "weight_scale": scales.half(),
        "weight_shape": torch.tensor(codes.shape),
    }
    if not sym:
        out["weight_zero_point"] = pack_to_int32((zeros - offset).to(torch.int8), bits, packed_dim=0)
    return out


def _group_index(k: int, group_size: int, desc_act: bool, seed: int) -> torch.Tensor:
    gs = group_size if group_size > 0 else k
    g_idx = torch.arange(k) // gs
    if desc_act:  # act order: group j holds columns perm[j*gs:(j+1)*gs] (GPTQ's perm: the Hessian diagonal, descending)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty_like(g_idx).scatter_(0, perm, g_idx)  # g_idx[perm] = arange // gs, as GPTQ's g_idx[invperm]
    return g_idx


def _fused_with_first(module: str) -> str:
    """The first projection fused with `module` in portside (q_proj for k/v, gate_proj for up, w1 for w3)."""
    head, _, last = module.rpartition(".")
    first = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}.get(last, last)
    return f"{head}.{first}"


def _fp8(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-8).float()
    return (w / scale).to(torch.float8_e4m3fn), scale


def _config(fmt: str, bits: int, group_size: int, desc_act: bool, sym: bool, static: bool) -> dict[str, Any]:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": not sym, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    weights: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "observer": "minmax"}
    acts = None
    if fmt in ("ct-w4a16", "ct-w8a16"):
        ct_format = "pack-quantized"
        weights.update(strategy="group" if group_size > 0 else "channel", group_size=group_size if group_size > 0 else None,
                       actorder="group" if desc_act else None)
    elif fmt == "ct-w8a8":
        ct_format = "int-quantized"
        weights.update(strategy="channel", symmetric=True)
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    else:  # ct-fp8
        ct_format = "float-quantized"
        weights.update(type="float", strategy="tensor" if static else "channel", symmetric=True)
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if static else "token",
                "dynamic": not static}
    return {
        "quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None,
    }


def write_quantized(
    src: str | Path,
    dst: str | Path,
    fmt: str,
    *,
    bits: int = 4,
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = True,
    static: bool = False,
    seed: int = 0,
    shared_act_order: bool = False,
) -> tuple[Path, Path]:
    """Write `fmt`'s checkpoint of `src` at `dst` and its dequantized oracle; returns both.
    `desc_act`: every projection's columns grouped in its own random order, unless
    `shared_act_order` gives the projections portside fuses one order."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    bits = {"awq": 4, "ct-w4a16": 4, "ct-w8a16": 8, "ct-w8a8": 8, "ct-fp8": 8, "fp8": 8}.get(fmt, bits)
    src, dst = Path(src), Path(dst)
    oracle = oracle_dir(dst)
    for d in (dst, oracle):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    input_amax: dict[str, float] = {}
    for i, (name, w) in enumerate(sorted(tensors.items())):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in _LINEARS:
            quantized[name] = dense[name] = w
            continue
        w = w.float()
        if fmt in ("fp8", "ct-fp8", "ct-w8a8"):
            if fmt == "ct-w8a8":
                scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
                q = (w / scale).round().clamp(-127, 127).to(torch.int8)
                deq = q.float() * scale
            else:
                q, scale = _fp8(w, per_tensor=static or fmt == "fp8")
                deq = q.float() * scale
                scale = scale.reshape(()) if fmt == "fp8" else scale.reshape(-1, 1) if not static else scale.reshape(1)
            quantized[f"{module}.weight"], quantized[f"{module}.weight_scale"] = q, scale
            if static:
                input_amax[module] = 4.0 + i % 3  # a calibrated activation range
                s = torch.tensor(input_amax[module] / FP8_MAX)
                quantized[f"{module}.input_scale"] = s.reshape(()) if fmt == "fp8" else s.reshape(1)
            dense[name] = deq
            continue
        b = bits
        order_of = _fused_with_first(module) if shared_act_order else module
        g_idx = _group_index(w.shape[1], group_size, desc_act and fmt in ("gptq", "ct-w4a16", "ct-w8a16"),
                             seed + zlib.crc32(order_of.encode()))
        codes, scales, zeros = quantize_rtn(w, b, group_size, sym, g_idx, min_zero=1 if fmt == "gptq" else 0)
        dense[name] = (codes.float() - zeros[:, g_idx]) * scales[:, g_idx]
        if fmt == "gptq":
            parts = gptq_pack(codes, scales, zeros, b) | {"g_idx": g_idx.to(torch.int32)}
        elif fmt == "awq":
            parts = awq_pack(codes, scales, zeros)
        else:
            parts = _ct_pack(codes, scales, zeros, b, sym)
            if desc_act:
                parts["weight_g_idx"] = g_idx.to(torch.int32)
        quantized |= {f"{module}.{k}": v for k, v in parts.items()}
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = _config(fmt, bits, group_size, desc_act, sym, static)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if input_amax:
        (oracle / "input_scales.json").write_text(json.dumps({m: a / FP8_MAX for m, a in input_amax.items()}))
    return dst, oracle
