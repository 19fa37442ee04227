"""`QuantConfig`: which quantized format a model is in, read from ``quantization_config`` in
config.json (what GPTQ, AWQ, llm-compressor, vLLM's fp8 and portside's GGUF converter write), or
chosen with ``--quantization`` to quantize a full-precision checkpoint while it loads.

Methods:
- ``gptq``: 4 or 8 bits, group size 32/64/128/-1, ``desc_act`` (``g_idx``), symmetric or not, the
  GPTQ v1 zero-point convention (stored zeros are one less; ``checkpoint_format: gptq_v2`` not);
- ``awq``: 4 bits, GEMM packing;
- ``compressed-tensors``: ``pack-quantized`` (int4/int8 weight-only, W4A16 / W8A16),
  ``int-quantized`` (int8 weights, int8 activations: W8A8) and ``float-quantized`` (FP8 weights,
  FP8 activations), per-channel, per-group or per-tensor scales, or FP8 per block (FP8_BLOCK:
  activations per token and group of 128);
- ``fp8``: vLLM/AutoFP8's FP8 checkpoints (per-tensor ``weight_scale``), block-wise FP8
  (``weight_block_size: [bn, bk]``, ``weight_scale_inv`` per bn x bk block: DeepSeek-V3/R1,
  Qwen3-FP8, transformers' ``FineGrainedFP8Config``; weight-only, see `_fp8`), or
  ``--quantization fp8``: any checkpoint quantized to FP8 per output channel at load,
  activations per token;
- ``mxfp4``: OpenAI's MXFP4 mixture-of-experts weights (gpt-oss: e2m1 codes, an e8m0 scale per
  32 input columns; `portside.quant.mxfp4`), the rest of the model in full precision;
- ``int8``: ``--quantization int8`` quantizes any checkpoint to int8 per output channel at load;
  weight-only unless ``--quantized-activations int8``;
- ``gguf``: llama.cpp block formats kept as they are in the file (`portside.quant.gguf`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["QuantConfig", "QUANT_METHODS", "ONLINE_METHODS"]

QUANT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "int8", "gguf", "mxfp4")
ONLINE_METHODS = ("int8", "fp8")  # may quantize a full-precision checkpoint at load
_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class QuantConfig:
    method: str
    bits: int = 8
    group_size: int = -1  # -1: one group per output channel
    desc_act: bool = False
    sym: bool = True
    gptq_v1_zeros: bool = True  # GPTQ v1 stores zero - 1
    ct_format: str = ""  # compressed-tensors compression format
    strategy: str = "channel"  # "channel", "group", "tensor" or "block" (scales)
    block: tuple[int, int] | None = None  # block-wise fp8: (rows, columns) per weight_scale_inv entry
    act: str | None = None  # None (weight-only), "int8" or "fp8": activations quantized per token
    act_static: bool = False  # activations use the checkpoint's calibrated input_scale
    act_group: int = 0  # > 0: activations rounded per token and group of this many columns
    online: bool = False  # quantize full-precision weights while loading
    ignore: tuple[str, ...] = ()  # modules left in full precision ("re:" prefix: a regex)
    quantize_lm_head: bool = False
    # gguf: (HF tensor name, GGML type name, rows, cols) of every tensor kept in llama.cpp's blocks
    gguf_tensors: tuple[tuple[str, str, int, int], ...] = field(default=(), repr=False)

    # ---- which layers -----------------------------------------------------------------------

    def quantizes(self, prefix: str) -> bool:
        """Is the linear layer at module path `prefix` (HF naming) quantized?"""
        if prefix.endswith("lm_head"):
            return self.quantize_lm_head
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return False
            elif "*" in pattern:  # transformers' wildcards (gpt-oss: "model.layers.*.self_attn")
                if fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, pattern + ".*"):
                    return False
            elif prefix == pattern or prefix.endswith("." + pattern) or f".{pattern}." in f".{prefix}.":
                return False
        return True

    # ---- parsing ----------------------------------------------------------------------------

    @classmethod
    def resolve(cls, hf_quant: dict[str, Any] | None, requested: str | None, activations: str | None = None) -> QuantConfig | None:
        """The config for a checkpoint whose config.json has `hf_quant` (its
        ``quantization_config``) when the user asked for `requested` (``--quantization``, None:
        what the checkpoint says) and `activations` (``--quantized-activations``). Raises
        ValueError naming the fix for an unknown or unsupported combination."""
        if requested is not None and requested not in QUANT_METHODS:
            raise ValueError(f"--quantization {requested!r} is not supported; use one of {', '.join(QUANT_METHODS)}")
        if activations not in (None, "none", "int8", "fp8"):
            raise ValueError(f"--quantized-activations {activations!r}: use none, int8 or fp8")
        stored = _method(hf_quant) if hf_quant else None
        if stored is None:
            if requested is None:
                if activations not in (None, "none"):
                    raise ValueError("--quantized-activations needs a quantized model or --quantization int8|fp8")
                return None
            if requested not in ONLINE_METHODS:
                raise ValueError(
                    f"the checkpoint is not quantized, and --quantization {requested} reads {requested} checkpoints; "
                    f"to quantize while loading use --quantization {' or '.join(ONLINE_METHODS)}"
                )
            return cls.online_method(requested, activations)
        if requested is not None and requested != stored:
            raise ValueError(
                f"the checkpoint is quantized with {stored} (config.json quantization_config), not {requested}; "
                f"drop --quantization or pass --quantization {stored}"
            )
        config = _PARSERS[stored](hf_quant or {})
        if activations not in (None, "none") and activations != config.act:
            raise ValueError(
                f"--quantized-activations {activations}: a {stored} checkpoint's activations are fixed by its "
                f"quantization_config ({config.act or 'not quantized'})"
            )
        return config

    @classmethod
    def online_method(cls, method: str, activations: str | None) -> QuantConfig:
        act = None if activations in (None, "none") else activations
        if method == "fp8":
            if act not in (None, "fp8"):
                raise ValueError("--quantization fp8 quantizes activations to fp8 per token; --quantized-activations int8 does not apply")
            return cls("fp8", bits=8, strategy="channel", act="fp8", online=True)
        if act not in (None, "int8"):
            raise ValueError("--quantization int8 takes --quantized-activations none or int8")
        return cls("int8", bits=8, strategy="channel", act=act, online=True)

    def describe(self) -> str:
        if self.method == "gguf":
            return "gguf (llama.cpp block formats)"
        if self.method == "mxfp4":
            return "mxfp4: experts in e2m1 with an e8m0 scale per 32 columns, weight-only"
        if self.block is not None:
            acts = (f", fp8 activations per token and {self.act_group} columns" if self.act_group else
                    ", fp8 activations per token" if self.act else ", weight-only")
            return f"{self.method}: fp8 in {self.block[0]}x{self.block[1]} blocks{acts}"
        what = "fp8" if self.method == "fp8" or self.ct_format == "float-quantized" else f"int{self.bits}"
        groups = f", group {self.group_size}" if self.group_size > 0 else f", per {self.strategy}"
        acts = f", {self.act} activations per token" + (" (static scale)" if self.act_static else "") if self.act else ", weight-only"
        return f"{self.method}{' (at load)' if self.online else ''}: {what}{groups}{acts}"


def _method(hf_quant: dict[str, Any]) -> str:
    m = str(hf_quant.get("quant_method", "")).lower().replace("_", "-")
    if m not in QUANT_METHODS or m == "int8":
        raise ValueError(
            f"quantization_config.quant_method {hf_quant.get('quant_method')!r} is not supported; "
            f"portside reads {', '.join(m for m in QUANT_METHODS if m != 'int8')} checkpoints"
        )
    return m


def _bits(value: Any, allowed: tuple[int, ...], what: str) -> int:
    bits = int(value)
    if bits not in allowed:
        raise ValueError(f"{what} with {bits} bits is not supported; portside reads {' and '.join(map(str, allowed))} bits")
    return bits


def _group(value: Any, what: str) -> int:
    g = int(value if value is not None else -1)
    if g != -1 and (g <= 0 or g % 8):
        raise ValueError(f"{what} group size {g} is not supported (use -1 or a positive multiple of 8)")
    return g


def _gptq(q: dict[str, Any]) -> QuantConfig:
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2); convert it with gptqmodel")
    return QuantConfig(
        "gptq", bits=_bits(q.get("bits", 4), (4, 8), "GPTQ"), group_size=_group(q.get("group_size", 128), "GPTQ"),
        desc_act=bool(q.get("desc_act", False)), sym=bool(q.get("sym", True)), gptq_v1_zeros=fmt == "gptq",
        strategy="group", ignore=tuple(q.get("modules_to_not_convert") or ()), quantize_lm_head=bool(q.get("lm_head", False)),
    )


def _awq(q: dict[str, Any]) -> QuantConfig:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: portside reads the GEMM packing (version: gemm)")
    return QuantConfig(
        "awq", bits=_bits(q.get("bits", q.get("w_bit", 4)), (4,), "AWQ"),
        group_size=_group(q.get("group_size", q.get("q_group_size", 128)), "AWQ"), sym=not q.get("zero_point", True),
        strategy="group", ignore=tuple(q.get("modules_to_not_convert") or ()),
    )


def _fp8(q: dict[str, Any]) -> QuantConfig:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic, static)")
    if q.get("weight_block_size"):
        return _fp8_block(q, scheme)
    return QuantConfig("fp8", bits=8, strategy="tensor", act="fp8", act_static=scheme == "static",
                       ignore=tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ()))


def _fp8_block(q: dict[str, Any], scheme: str) -> QuantConfig:
    """Block-wise FP8 (transformers' FineGrainedFP8, DeepSeek-V3): weights and their blocks'
    scales kept as stored, multiplied in the kernel. Activations stay in the compute dtype: what
    transformers computes on cpu (``dequantize``: every block times its scale, then a
    full-precision matmul) and the reference the greedy tests hold portside to; DeepSeek's GPU
    kernels round them to fp8 per 128 columns first, which portside does not do."""
    block = q["weight_block_size"]
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 weight_block_size {block!r} must be two positive integers [rows, columns]")
    if scheme == "static":
        raise ValueError("block-wise FP8 with activation_scheme static (a calibrated activation_scale) is not supported; "
                         "portside reads activation_scheme dynamic block-wise checkpoints")
    if str(q.get("fmt") or "e4m3") != "e4m3":  # DeepSeek-V3 / Qwen3-FP8 configs say fmt: e4m3
        raise ValueError(f"block-wise FP8 with fmt {q.get('fmt')!r} is not supported (e4m3 weights only)")
    fmt = str(q.get("scale_fmt") or "float")
    if fmt != "float":
        raise ValueError(f"block-wise FP8 with scale_fmt {fmt!r} is not supported (float32 weight_scale_inv only)")
    if str(q.get("expert_dtype") or "fp8") != "fp8":
        raise ValueError(f"block-wise FP8 with expert_dtype {q.get('expert_dtype')!r} is not supported (fp8)")
    if q.get("modules_to_convert"):
        raise ValueError("block-wise FP8 with modules_to_convert (fp8 embeddings) is not supported")
    return QuantConfig("fp8", bits=8, strategy="block", block=(int(block[0]), int(block[1])),
                       ignore=tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ()))


def _mxfp4(q: dict[str, Any]) -> QuantConfig:
    return QuantConfig("mxfp4", bits=4, group_size=32, strategy="block", ignore=tuple(q.get("modules_to_not_convert") or ()))


def _compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    fmt = q.get("format", "")
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (exactly one)")
    group = groups[0]
    w, a = group.get("weights") or {}, group.get("input_activations")
    if fmt not in _CT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; portside reads {', '.join(_CT_FORMATS)}")
    wtype, strategy = w.get("type", "int"), w.get("strategy", "channel")
    if strategy not in ("channel", "group", "tensor", "block"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported (channel, group, tensor, block)")
    if strategy == "block":
        return _ct_fp8_block(q, w, a)
    if fmt == "float-quantized" or wtype == "float":
        if int(w.get("num_bits", 8)) != 8 or strategy == "group":
            raise ValueError("compressed-tensors float weights: 8-bit FP8 with per-tensor or per-channel scales only")
        fmt = "float-quantized"
    elif fmt == "pack-quantized":
        _bits(w.get("num_bits", 4), (4, 8), "compressed-tensors pack-quantized")
    elif int(w.get("num_bits", 8)) != 8 or not w.get("symmetric", True):
        raise ValueError("compressed-tensors int-quantized weights: symmetric int8 only")
    act, static = None, False
    if a:
        atype = a.get("type", "int")
        act = "fp8" if atype == "float" else "int8"
        static = not a.get("dynamic", True)
        if a.get("strategy", "token") not in ("token", "tensor") or int(a.get("num_bits", 8)) != 8:
            raise ValueError("compressed-tensors input activations: 8 bits, per token or per tensor only")
        if not a.get("symmetric", True):
            raise ValueError("compressed-tensors asymmetric input activations are not supported")
    if fmt == "pack-quantized" and act:
        raise ValueError("compressed-tensors pack-quantized weights with quantized activations are not supported")
    actorder = w.get("actorder")
    return QuantConfig(
        "compressed-tensors", bits=int(w.get("num_bits", 8)), group_size=int(w.get("group_size") or -1) if strategy == "group" else -1,
        desc_act=actorder == "group", sym=bool(w.get("symmetric", True)), ct_format=fmt, strategy=strategy, act=act,
        act_static=static, ignore=tuple(q.get("ignore") or ()),
        quantize_lm_head=not any(p.removeprefix("re:").rstrip("$").endswith("lm_head") for p in q.get("ignore") or ()),
    )


def _ct_fp8_block(q: dict[str, Any], w: dict[str, Any], a: dict[str, Any] | None) -> QuantConfig:
    """compressed-tensors' block-wise FP8 (llm-compressor's FP8_BLOCK scheme): e4m3 weights with
    ``weight_scale`` per ``block_structure`` block, activations rounded to fp8 per token and group
    of columns (dynamic) or not at all."""
    block = w.get("block_structure")
    if w.get("type") != "float" or int(w.get("num_bits", 8)) != 8 or not w.get("symmetric", True) or not (
            isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError("compressed-tensors block weights: symmetric 8-bit float (FP8) with a block_structure [rows, columns]")
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors block weights in format {q.get('format')!r}: float-quantized only")
    act, group = None, 0
    if a:
        if a.get("type") != "float" or int(a.get("num_bits", 8)) != 8 or not a.get("dynamic", False) \
                or a.get("strategy") not in ("group", "token") or not a.get("symmetric", True):
            raise ValueError("compressed-tensors block weights: input activations must be dynamic symmetric FP8 per token "
                             "or per token group")
        act, group = "fp8", int(a.get("group_size") or 0) if a.get("strategy") == "group" else 0
    return QuantConfig("compressed-tensors", bits=8, ct_format="float-quantized", strategy="block",
                       block=(int(block[0]), int(block[1])), act=act, act_group=group, ignore=tuple(q.get("ignore") or ()),
                       quantize_lm_head=not any(p.removeprefix("re:").rstrip("$").endswith("lm_head") for p in q.get("ignore") or ()))


def _gguf(q: dict[str, Any]) -> QuantConfig:
    """portside's GGUF converter: ``tensors: {hf_name: {"type": "Q4_K", "shape": [rows, cols]}}``
    (an ``{e}`` in a name stands for every expert)."""
    try:
        tensors = tuple(sorted((str(name), str(t["type"]), int(t["shape"][0]), int(t["shape"][1]))
                               for name, t in (q.get("tensors") or {}).items()))
    except (KeyError, TypeError, ValueError, IndexError):
        raise ValueError('gguf quantization_config.tensors must map tensor names to {"type": "Q4_K", "shape": [rows, cols]}') from None
    return QuantConfig("gguf", strategy="block", gguf_tensors=tensors)


_PARSERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors, "gguf": _gguf, "mxfp4": _mxfp4}
