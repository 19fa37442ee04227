"""GGUF files served quantized: each weight stays in llama.cpp's blocks (`gguf_blocks`) from the
file to the matmul, as a `QuantWeight` of kind "gguf".

The converter (`portside.model.gguf_loader`) writes a quantized tensor as its raw uint8 rows
[rows, row_bytes] and lists it in config.json's ``quantization_config.tensors`` with its GGML
type and logical shape. `prepare_gguf_model` (before the checkpoint loads) gives every layer
that has such a tensor a uint8 parameter whose weight_loader keeps this rank's rows (any split:
fused q/k/v and gate/up parts through `LinearBase.out_partition`) and, for a row-parallel layer,
its whole blocks of input columns; `finalize_gguf_model` (after) turns them into QuantWeights
the platform prepares. What happens where:

- a linear layer whose parts have one type: one QuantWeight;
- a fused layer whose parts have different types (llama.cpp's Q4_K_M keeps attn_v in Q6_K,
  attn_q in Q4_K): one QuantWeight per part, computed one after the other and concatenated
  (`GGUFSplitLinear`); a part the file keeps in float is such a part too (type F32/F16/BF16);
- the token embedding and the LM head (one QuantWeight when tied);
- MoE experts: w13 and w2 stacked [E, ..]; if an expert's gate and up differ in type, that
  layer's w13 is dequantized at load (logged) and kept as a float-typed QuantWeight;
- anything else a quantized tensor fills (a router) is dequantized as it loads.

A tensor whose bytes do not fit its type and shape raises ValueError naming it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from portside.contract import ModelOps
from portside.model.layers import LinearBase, VocabParallelEmbedding, default_weight_loader
from portside.model.moe import MoEExperts
from portside.quant.config import QuantConfig
from portside.quant.gguf_blocks import block_shape, dequantize_blocks, row_bytes, type_from_name, type_name
from portside.quant.weight import QuantWeight

__all__ = ["dequantize_blocks", "GGUFPart", "GGUFSplitLinear", "gguf_parts", "prepare_gguf_model", "finalize_gguf_model"]

logger = logging.getLogger(__name__)

_FLOAT_TYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class GGUFPart:
    """One quantized checkpoint part: what a (parameter, shard id) of the model is loaded from."""

    name: str  # the checkpoint tensor (for messages)
    ggml_type: int
    rows: int  # rows of the part in the checkpoint (every rank's slice is cut from these)
    cols: int  # K, logical values per row

    @property
    def type(self) -> str:
        return type_name(self.ggml_type)


def gguf_parts(model: nn.Module, qc: QuantConfig) -> dict[str, dict[object, GGUFPart]]:
    """parameter name -> shard id -> the quantized part it loads, from ``qc.gguf_tensors``: each
    tensor is routed through the model's own `checkpoint_tensors` (renames, fused checkpoint
    tensors, experts), as `load_weights` will route it."""
    num_experts = int(getattr(model.config, "num_experts", 0) or 0)  # type: ignore[union-attr]
    out: dict[str, dict[object, GGUFPart]] = {}
    for name, tname, rows, cols in qc.gguf_tensors:
        try:
            ggml_type = type_from_name(tname)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        for hf in [name.format(e=e) for e in range(num_experts)] if "{e}" in name else [name]:
            meta = torch.empty(rows, cols, device="meta")
            for target, shard, part in model.checkpoint_tensors(hf, meta):  # type: ignore[operator]
                out.setdefault(target, {})[shard] = GGUFPart(hf, ggml_type, int(part.shape[0]), cols)
    return out


@dataclass
class _Prepared:
    """What `prepare_gguf_model` leaves on a module for `finalize_gguf_model` (attribute `_STATE`).

    ``types``: a linear layer's GGML type per shard id (None: a part kept in float), the
    embedding's under None, the experts' under "w13" / "w2"; ``cols``: the input features this
    rank keeps, under the same keys where they are not the layer's own; ``split``: a fused layer
    whose parts are kept apart (`GGUFSplitLinear`)."""

    types: dict[object, int | None]
    cols: dict[object, int] = field(default_factory=dict)
    split: bool = False


_STATE = "gguf_prepared"


def _prepared(module: nn.Module) -> _Prepared | None:
    return cast("_Prepared | None", getattr(module, _STATE, None))


def _mark(module: nn.Module, state: _Prepared) -> None:
    setattr(module, _STATE, state)


# ---- loading one part ---------------------------------------------------------------------------


def _check_rows(loaded: torch.Tensor, part: GGUFPart) -> None:
    """`loaded` must be `part`'s whole rows of blocks (uint8 [rows, row_bytes])."""
    if loaded.dtype != torch.uint8:
        raise ValueError(f"is stored as {loaded.dtype}; a {part.type} tensor is uint8 rows of blocks")
    expected = (part.rows, row_bytes(part.ggml_type, part.cols))
    if tuple(loaded.shape) != expected:
        raise ValueError(f"has shape {tuple(loaded.shape)}, but {part.rows} rows of {part.cols} {part.type} values are "
                         f"{list(expected)} bytes (truncated or not {part.type})")


def _columns(layer: LinearBase, part: GGUFPart | None) -> tuple[int, int] | None:
    """(first, count) of this rank's storage columns of a part: bytes of whole blocks, or values
    of a float part; None: all."""
    cols = layer.in_partition()
    if cols is None:
        return None
    start, size = cols
    if part is None:
        return start, size
    bs, ts = block_shape(part.ggml_type)
    return start // bs * ts, size // bs * ts


def _load_part(layer: LinearBase, dst: torch.Tensor, loaded: torch.Tensor, shard: object, part: GGUFPart | None) -> None:
    """Copy this rank's rows (and input columns) of one checkpoint part into `dst`."""
    if part is not None:
        _check_rows(loaded, part)
    elif not loaded.is_floating_point():
        raise ValueError(f"is stored as {loaded.dtype}, expected a float tensor (it is not in quantization_config.tensors)")
    _, src, n = layer.out_partition(shard)
    t = loaded.narrow(0, src, n)
    cols = _columns(layer, part)
    if cols is not None:
        t = t.narrow(1, *cols)
    if tuple(t.shape) != tuple(dst.shape):
        raise ValueError(f"this rank's slice has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(t)


def _placeholder(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=like.device), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


# ---- preparing the layers -----------------------------------------------------------------------


def _full_cols(layer: LinearBase) -> int:
    return layer.in_local * (getattr(layer, "tp_size", 1) if layer.in_partition() is not None else 1)


def _check_layer(layer: LinearBase, name: str, parts: dict[object, GGUFPart]) -> None:
    k = _full_cols(layer)
    for part in parts.values():
        if part.cols != k:
            raise ValueError(f"checkpoint tensor {part.name!r} has {part.cols} columns, {name} has {k} input features")
        bs = block_shape(part.ggml_type)[0]
        if layer.in_partition() is not None and layer.in_local % bs:
            raise ValueError(
                f"checkpoint tensor {part.name!r}: {part.type} blocks of {bs} values cannot be split over "
                f"{getattr(layer, 'tp_size', 1)} ranks ({layer.in_local} input features each): its {k} input features "
                f"are {k // bs} blocks, so the tensor-parallel size must divide {k // bs}"
            )


def _prepare_linear(layer: LinearBase, name: str, parts: dict[object, GGUFPart], ops: ModelOps) -> None:
    shards = layer.parts or [None]
    _check_layer(layer, name, parts)
    types = {parts[s].ggml_type if s in parts else None for s in shards}
    layer.ops = ops
    weight = layer.weight
    assert weight is not None
    if len(types) == 1:  # one type for every part: one uint8 weight
        (ggml_type,) = types
        assert ggml_type is not None

        def load(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
            d0, _, n = layer.out_partition(shard)
            _load_part(layer, param.data.narrow(0, d0, n), loaded, shard, parts[shard])

        p = _placeholder(weight, (layer.out_local, row_bytes(ggml_type, layer.in_local)), torch.uint8, load)
    else:  # a buffer per part, in its own type (or the model's float dtype)
        buffers: dict[object, torch.Tensor] = {}
        for i, s in enumerate(shards):
            n = layer.out_partition(s)[2]
            part = parts.get(s)
            shape = (n, row_bytes(part.ggml_type, layer.in_local)) if part else (n, layer.in_local)
            buffers[s] = torch.zeros(shape, dtype=torch.uint8 if part else weight.dtype, device=weight.device)
            layer.register_buffer(f"gguf_part{i}", buffers[s])

        def load(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
            _load_part(layer, buffers[shard], loaded, shard, parts.get(shard))

        p = _placeholder(weight, (0,), torch.uint8, load)
    if layer.parts is not None:
        p.shard_ids = layer.parts  # type: ignore[attr-defined]
    del layer.weight
    layer.weight = p
    _mark(layer, _Prepared({s: parts[s].ggml_type if s in parts else None for s in shards}, split=len(types) > 1))


def _prepare_embedding(module: VocabParallelEmbedding, part: GGUFPart, ops: ModelOps) -> nn.Parameter:
    weight = module.weight
    hidden = weight.shape[1]
    if part.cols != hidden or part.rows != module.vocab_size:
        raise ValueError(f"checkpoint tensor {part.name!r} is [{part.rows}, {part.cols}], expected "
                         f"[{module.vocab_size}, {hidden}] (vocabulary, hidden size)")

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        _check_rows(loaded, part)
        n = max(0, min(module.rows, module.vocab_size - module.start))
        param.data.zero_()  # the last rank's padding rows: zero blocks decode to zeros
        param.data[:n].copy_(loaded.narrow(0, module.start, n))

    p = _placeholder(weight, (module.rows, row_bytes(part.ggml_type, hidden)), torch.uint8, load)
    del module.weight
    module.weight = p
    module.ops = ops
    _mark(module, _Prepared({None: part.ggml_type}, {None: hidden}))
    return p


def _prepare_experts(module: MoEExperts, name: str, pname: str, parts: dict[object, GGUFPart]) -> None:
    """experts.w13 [E, 2I/tp, hidden] / w2 [E, hidden, I/tp]: one uint8 [E, rows, row_bytes] when
    every part has one type, else the float weight, its quantized parts dequantized as they load."""
    dense = getattr(module, pname)
    e_count, rows, k = dense.shape  # k: this rank's input features
    n = module.local  # this rank's share of an expert's intermediate size
    for part in parts.values():
        if (part.cols != k) if pname == "w13" else (part.cols % k):
            raise ValueError(f"checkpoint tensor {part.name!r} has {part.cols} columns, which do not fit the experts' "
                             f"{k} input features per rank")
    types = {p.ggml_type for p in parts.values()}
    if len(types) != 1 or set(parts) != set(dense.shard_ids):
        logger.warning("%s.%s: the experts' parts are stored as %s; dequantized to %s at load", name, pname,
                       ", ".join(sorted({type_name(t) for t in types})), str(dense.dtype).removeprefix("torch."))
        dense.weight_loader = _dequantizing(dense.weight_loader, parts)  # type: ignore[attr-defined]
        return
    (ggml_type,) = types
    bs, ts = block_shape(ggml_type)
    if k % bs:
        raise ValueError(f"checkpoint tensor {next(iter(parts.values())).name!r}: {type_name(ggml_type)} blocks of {bs} "
                         f"values cannot be split into {k} input features per rank: the tensor-parallel size must "
                         f"divide {next(iter(parts.values())).cols // bs}")

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        part = parts[shard]
        _check_rows(loaded, part)
        e, which = cast(tuple[int, str], shard)
        if which == "down":  # [hidden, I]: this rank's whole blocks of I
            param.data[e].copy_(loaded.narrow(1, module.tp_rank * n // bs * ts, n // bs * ts))
        else:  # [I, hidden]: this rank's rows, gate then up
            dst = param.data[e, :n] if which == "gate" else param.data[e, n:]
            dst.copy_(loaded.narrow(0, module.tp_rank * n, n))

    p = _placeholder(dense, (e_count, rows, k // bs * ts), torch.uint8, load)
    p.shard_ids = dense.shard_ids  # type: ignore[attr-defined]
    delattr(module, pname)
    module.register_parameter(pname, p)
    state = _prepared(module) or _Prepared({})
    state.types[pname], state.cols[pname] = ggml_type, k
    _mark(module, state)


def _dequantizing(loader: Callable[..., None], parts: dict[object, GGUFPart]) -> Callable[..., None]:
    """A weight_loader that first dequantizes a quantized part (to fp32), then loads it as before."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        part = parts.get(shard)
        if part is not None and loaded.dtype == torch.uint8:
            _check_rows(loaded, part)
            loaded = dequantize_blocks(loaded, part.ggml_type, part.cols).to(param.dtype)
        loader(param, loaded, shard)

    return load


def prepare_gguf_model(model: nn.Module, qc: QuantConfig, ops: ModelOps) -> None:
    """Give every layer a quantized checkpoint tensor fills its uint8 parameter (see the module
    docstring). Raises ValueError naming a tensor that cannot be placed or split."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)  # type: ignore[union-attr]
    for target, parts in gguf_parts(model, qc).items():
        if target not in params:
            raise ValueError(f"checkpoint tensor {next(iter(parts.values())).name!r} has no place in {type(model).__name__}")
        mod_name, _, pname = target.rpartition(".")
        module = modules[mod_name]
        if isinstance(module, LinearBase) and pname == "weight" and module.quantizable:
            _prepare_linear(module, mod_name, parts, ops)
        elif isinstance(module, VocabParallelEmbedding) and pname == "weight" and None in parts:
            p = _prepare_embedding(module, parts[None], ops)
            lm_head = modules.get("lm_head")
            if tied and isinstance(lm_head, VocabParallelEmbedding) and lm_head is not module:
                del lm_head.weight
                lm_head.weight = p  # the tied head shares the table
                lm_head.ops = ops
                _mark(lm_head, cast(_Prepared, _prepared(module)))
        elif isinstance(module, MoEExperts) and pname in ("w13", "w2"):
            _prepare_experts(module, mod_name, pname, parts)
        else:
            param = params[target]
            param.weight_loader = _dequantizing(getattr(param, "weight_loader", default_weight_loader), parts)  # type: ignore[attr-defined]


# ---- after loading ------------------------------------------------------------------------------


class GGUFSplitLinear(nn.Module):
    """A fused column-parallel layer whose checkpoint parts have different GGML types: each part
    one QuantWeight (``quant``, in output order), multiplied one after the other, concatenated."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, ops: ModelOps) -> None:
        super().__init__()
        self.quant = nn.ModuleList(parts)
        self.bias = bias
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum of the parts' rows]
        y = torch.cat([self.ops.quantized_linear(x, w) for w in self.quant], dim=-1)  # type: ignore[arg-type]
        return y + self.bias if self.bias is not None else y


def _float_weight(w: torch.Tensor) -> QuantWeight:
    """A float tensor [.., N, K] as a QuantWeight of GGML type F32/F16/BF16 (sharing its storage)."""
    return QuantWeight("gguf", (w.shape[-2], w.shape[-1]), w.detach().contiguous().view(torch.uint8),
                       ggml_type=type_from_name(_FLOAT_TYPE[w.dtype]), method="gguf")


def _finalize_linear(name: str, layer: LinearBase, ops: ModelOps) -> tuple[str, nn.Module] | None:
    """The layer's QuantWeight (set in place), or for mixed parts the (name, GGUFSplitLinear) replacing it."""
    state = cast(_Prepared, _prepared(layer))
    assert layer.weight is not None
    if not state.split:
        (ggml_type,) = set(state.types.values())
        qw = QuantWeight("gguf", (layer.out_local, layer.in_local), layer.weight.data, ggml_type=ggml_type, method="gguf")
        del layer.weight
        layer.weight = None
        layer.quant = ops.prepare_quantized(qw)
        return None
    shards = sorted(layer.parts or [None], key=lambda s: layer.out_partition(s)[0])
    parts = []
    for s in shards:
        buf = layer.get_buffer(f"gguf_part{(layer.parts or [None]).index(s)}")
        ggml_type = state.types[s]
        if ggml_type is None:
            qw = _float_weight(buf)
        else:
            qw = QuantWeight("gguf", (buf.shape[0], layer.in_local), buf, ggml_type=ggml_type, method="gguf")
        parts.append(ops.prepare_quantized(qw))
    return name, GGUFSplitLinear(parts, layer.bias, ops)


def finalize_gguf_model(model: nn.Module, qc: QuantConfig, ops: ModelOps) -> None:
    """Turn every loaded uint8 parameter into a prepared `QuantWeight` (see the module docstring)."""
    replaced: list[tuple[str, nn.Module]] = []
    types: Counter[str] = Counter()
    embed_quant: dict[int, nn.Module] = {}
    for name, module in list(model.named_modules()):
        state = _prepared(module)
        if state is None:
            continue
        if isinstance(module, LinearBase):
            for t in state.types.values():
                types[type_name(t) if t is not None else "float"] += 1
            swap = _finalize_linear(name, module, ops)
            if swap is not None:
                replaced.append(swap)
        elif isinstance(module, VocabParallelEmbedding):
            weight = module.weight
            if id(weight) not in embed_quant:  # a tied LM head shares the embedding's QuantWeight
                qw = QuantWeight("gguf", (weight.shape[0], state.cols[None]), weight.data, ggml_type=state.types[None],
                                 method="gguf")
                embed_quant[id(weight)] = ops.prepare_quantized(qw)
                types[type_name(cast(int, state.types[None]))] += 1
            module.quant = embed_quant[id(weight)]
            del module.weight
            module.weight = None  # type: ignore[assignment]
        elif isinstance(module, MoEExperts):
            quant = {}
            for pname in ("w13", "w2"):
                w = getattr(module, pname)
                if pname in state.types:
                    qw = QuantWeight("gguf", (w.shape[1], state.cols[pname]), w.data, ggml_type=state.types[pname],
                                     method="gguf")
                else:  # dequantized at load, or stored in float: the same contract, type F32/F16/BF16
                    qw = _float_weight(w)
                types[type_name(qw.ggml_type)] += 1  # type: ignore[arg-type]
                quant[pname] = ops.prepare_quantized(qw)
                delattr(module, pname)
            module.quant13, module.quant2 = quant["w13"], quant["w2"]
        delattr(module, _STATE)
    for name, new in replaced:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    logger.info("gguf: %s served in llama.cpp's block formats (%s)%s", type(model).__name__,
                ", ".join(f"{n} x{c}" for n, c in sorted(types.items())),
                f"; {len(replaced)} fused layers computed part by part (their parts differ in type)" if replaced else "")
