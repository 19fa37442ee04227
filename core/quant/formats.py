"""Checkpoint formats of quantized linear layers: the tensors each format stores for one layer (in
its own names and packing), how a rank's slice of them is loaded, and their conversion to the
canonical `QuantWeight` once every part has arrived.

A format replaces a `LinearBase`'s dense ``weight`` with parameters named as in the checkpoint
(``qweight``, ``qzeros``, ``scales``, ``g_idx`` for GPTQ), so `DecoderForCausalLM.load_weights`
fills them like any other: ``q_proj.qweight`` goes to part "q" of ``qkv_proj.qweight``. Each
parameter's `CkptParam` says which of its axes runs over output rows (N, possibly packed several
to an int32) and which over input columns (K, packed, or one entry per group), which is all the
tensor-parallel and fused-part slicing needs (`LinearBase.out_partition` / `in_partition`).

Act order: every projection of an act-order checkpoint has its own ``g_idx`` (which group each
input column is in), and fused projections (q/k/v, gate/up, an expert's gate/up) need not agree.
A fused layer keeps one ``g_idx`` per part; where they are equal (or in order) it stays one
`QuantWeight`, else `to_quant_weights` returns its parts, each with its own ``g_idx``, computed
one after the other (`QuantParts`): one grouping of the input columns cannot serve rows that
are grouped differently, and so every part keeps the platform's act-order kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from portside.model.layers import LinearBase
from portside.quant.config import QuantConfig
from portside.quant.fp8_block import block_scale_loader, block_scale_shape
from portside.quant.weight import QuantWeight, pack_int4, quantize_per_channel

__all__ = [
    "CkptParam", "checkpoint_params", "add_checkpoint_params", "add_expert_params", "stacked_expert_weights",
    "to_quant_weights", "unpack_int32",
]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]


@dataclass(frozen=True)
class CkptParam:
    """One checkpoint tensor of a quantized linear layer (shapes in `checkpoint_params`)."""

    name: str
    dtype: torch.dtype  # how portside keeps it: the packed integer type, or fp32 for scales
    shape: Callable[[int, int, int], tuple[int, ...]]  # (N, K, groups) of this rank -> shape
    out_dim: int | None = None  # axis over output rows
    out_pack: int = 1  # rows per element along out_dim
    in_dim: int | None = None  # axis over input columns
    in_unit: int | str = 1  # columns per element along in_dim, or "group"
    per_part: bool = False  # one value per fused part: [parts, ...] (a scalar, or a g_idx over the input columns)
    optional: bool = False
    integer: bool = False  # must arrive as exactly `dtype`
    block: tuple[int, int] | None = None  # block-wise fp8 scales: loaded by `fp8_block.block_scale_loader`


def checkpoint_params(qc: QuantConfig) -> list[CkptParam]:
    """The tensors `qc`'s format stores per linear layer (empty: the dense ``weight`` stays)."""
    i32, f32 = torch.int32, torch.float32
    if qc.method == "gptq":
        pf = 32 // qc.bits
        return [
            CkptParam("qweight", i32, lambda n, k, g: (k // pf, n), out_dim=1, in_dim=0, in_unit=pf, integer=True),
            CkptParam("qzeros", i32, lambda n, k, g: (g, n // pf), out_dim=1, out_pack=pf, in_dim=0, in_unit="group", integer=True),
            CkptParam("scales", f32, lambda n, k, g: (g, n), out_dim=1, in_dim=0, in_unit="group"),
            CkptParam("g_idx", i32, lambda n, k, g: (k,), in_dim=0, per_part=True, optional=True, integer=True),
        ]
    if qc.method == "awq":
        return [
            CkptParam("qweight", i32, lambda n, k, g: (k, n // 8), out_dim=1, out_pack=8, in_dim=0, integer=True),
            CkptParam("qzeros", i32, lambda n, k, g: (g, n // 8), out_dim=1, out_pack=8, in_dim=0, in_unit="group", integer=True),
            CkptParam("scales", f32, lambda n, k, g: (g, n), out_dim=1, in_dim=0, in_unit="group"),
        ]
    if qc.method == "compressed-tensors" and qc.ct_format == "pack-quantized":
        pf = 32 // qc.bits
        params = [
            CkptParam("weight_packed", i32, lambda n, k, g: (n, k // pf), out_dim=0, in_dim=1, in_unit=pf, integer=True),
            CkptParam("weight_scale", f32, lambda n, k, g: (n, g), out_dim=0, in_dim=1, in_unit="group"),
            CkptParam("weight_shape", torch.int64, lambda n, k, g: (2,), per_part=True, integer=True),
        ]
        if not qc.sym:
            params.append(CkptParam("weight_zero_point", i32, lambda n, k, g: (n // pf, g), out_dim=0, out_pack=pf,
                                    in_dim=1, in_unit="group", integer=True))
        if qc.desc_act:
            params.append(CkptParam("weight_g_idx", i32, lambda n, k, g: (k,), in_dim=0, per_part=True, integer=True))
        return params
    if qc.block is not None:  # block-wise fp8: transformers / DeepSeek's weight_scale_inv, compressed-tensors' weight_scale
        scale = "weight_scale_inv" if qc.method == "fp8" else "weight_scale"
        return [CkptParam("weight", torch.float8_e4m3fn, lambda n, k, g: (n, k), out_dim=0, in_dim=1, integer=True),
                CkptParam(scale, f32, block_scale_shape(qc.block), block=qc.block)]
    if qc.method in ("compressed-tensors", "fp8") and not qc.online:
        fp8 = qc.method == "fp8" or qc.ct_format == "float-quantized"
        wdtype = torch.float8_e4m3fn if fp8 else torch.int8
        params = [CkptParam("weight", wdtype, lambda n, k, g: (n, k), out_dim=0, in_dim=1, integer=True)]
        if qc.strategy == "channel":
            params.append(CkptParam("weight_scale", f32, lambda n, k, g: (n, 1), out_dim=0))
        else:
            params.append(CkptParam("weight_scale", f32, lambda n, k, g: (1,), per_part=True))
        if qc.act_static:
            params.append(CkptParam("input_scale", f32, lambda n, k, g: (1,), per_part=True))
        return params
    return []  # online int8 / fp8: the dense weight loads, then is quantized


def _groups(qc: QuantConfig, layer: LinearBase) -> tuple[int, bool]:
    """(groups this rank keeps, whether the groups are sliced with the input columns)."""
    if qc.group_size <= 0:
        return 1, False
    cols = layer.in_partition()
    full_k = layer.in_local if cols is None else layer.in_local * getattr(layer, "tp_size", 1)
    if qc.desc_act and cols is not None:
        return full_k // qc.group_size, False  # act order: any column may use any group
    if layer.in_local % qc.group_size:
        raise ValueError(f"{layer.in_local} input features per rank are not a multiple of the group size {qc.group_size}")
    return layer.in_local // qc.group_size, cols is not None


def add_checkpoint_params(layer: LinearBase, qc: QuantConfig) -> None:
    """Replace `layer`'s dense weight with `qc`'s checkpoint tensors (a no-op for online methods)."""
    specs = checkpoint_params(qc)
    if not specs:
        return
    del layer.weight
    for spec in specs:
        layer.register_parameter(spec.name, _make_param(layer, spec, qc, layer.parts))
    if "weight" not in layer._parameters:
        layer.weight = None
    layer.quant_format = qc  # type: ignore[assignment]


def _make_param(layer: Any, spec: CkptParam, qc: QuantConfig, shard_ids: list[object] | None,
                experts: int | None = None) -> nn.Parameter:
    groups, sliced = _groups(qc, layer)
    shape = spec.shape(layer.out_local, layer.in_local, groups)
    if spec.per_part:
        shape = (len(layer.parts or [None]), *shape)
    if experts is not None:
        shape = (experts, *shape)
    p = nn.Parameter(torch.zeros(shape, dtype=spec.dtype), requires_grad=False)
    p.weight_loader = block_scale_loader(layer, spec.block, spec.name) if spec.block else _loader(layer, spec, qc, sliced)  # type: ignore[attr-defined]
    if shard_ids is not None:
        p.shard_ids = shard_ids  # type: ignore[attr-defined]
    p.optional = spec.optional  # type: ignore[attr-defined]
    p.loaded_parts = set()  # type: ignore[attr-defined]
    return p


class ExpertSlot:
    """`MoEExperts.w13` or `.w2` seen as the linear layer one expert's part is (what the loaders and
    `to_quant_weights` ask of a layer). w13: gate and up, output rows split over ranks; w2: down,
    input columns split."""

    stacked = True

    def __init__(self, experts: Any, which: str) -> None:
        self.experts, self.which = experts, which
        self.tp_rank, self.tp_size, local = experts.tp_rank, experts.tp_size, experts.local
        if which == "w13":
            self.in_local, self.out_local, self.parts = experts.hidden_size, 2 * local, ["gate", "up"]
        else:
            self.in_local, self.out_local, self.parts = local, experts.hidden_size, ["down"]

    def out_partition(self, shard_id: object = None) -> tuple[int, int, int]:
        if self.which == "w2":
            return 0, 0, self.out_local
        n = self.experts.local
        return (0 if shard_id == "gate" else n), self.tp_rank * n, n

    def in_partition(self) -> tuple[int, int] | None:
        return (self.tp_rank * self.in_local, self.in_local) if self.which == "w2" and self.tp_size > 1 else None

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return self.out_local if self.which == "w2" else self.experts.local * self.tp_size

    def part_index(self, shard_id: object) -> int:
        return self.parts.index(shard_id)  # type: ignore[arg-type]


def add_expert_params(experts: Any, qc: QuantConfig) -> None:
    """Replace a `MoEExperts`' dense w13 / w2 with `qc`'s checkpoint tensors stacked over the
    experts: ``w13_qweight`` [E, ...] and so on (a format's ``weight`` keeps the name w13 / w2);
    each expert's ``experts.{e}.gate_proj.qweight`` is part (e, "gate")."""
    specs = checkpoint_params(qc)
    for which in ("w13", "w2"):
        slot = ExpertSlot(experts, which)
        delattr(experts, which)
        shard_ids: list[object] = [(e, part) for e in range(experts.num_experts) for part in slot.parts]
        for spec in specs:
            name = which if spec.name == "weight" else f"{which}_{spec.name}"
            experts.register_parameter(name, _make_param(slot, spec, qc, shard_ids, experts.num_experts))
    experts.quant_format = qc


class _ExpertView:
    """Expert e of a stacked slot, for `to_quant_weights`."""

    def __init__(self, slot: ExpertSlot, e: int) -> None:
        self.slot, self.e = slot, e
        self.out_local, self.in_local, self.parts = slot.out_local, slot.in_local, slot.parts
        self.tp_size = slot.tp_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.slot, name)

    def get_parameter(self, name: str) -> torch.Tensor:
        which = self.slot.which
        p = self.slot.experts.get_parameter(which if name == "weight" else f"{which}_{name}")
        view = p.data[self.e]
        view.loaded_parts = {part for e, part in p.loaded_parts if e == self.e}  # type: ignore[attr-defined]
        return view


def stacked_expert_weights(experts: Any, qc: QuantConfig) -> tuple[list[QuantWeight], list[QuantWeight]]:
    """The loaded experts' (w13, w2) as canonical QuantWeights stacked [E, ...]: each one weight,
    or w13 as [gate, up] stacked apart where some expert's gate and up act orders differ; the
    checkpoint tensors are removed."""
    out = []
    for which in ("w13", "w2"):
        slot = ExpertSlot(experts, which)
        per_expert = []
        for e in range(experts.num_experts):
            try:
                per_expert.append(to_quant_weights(_ExpertView(slot, e), qc))  # type: ignore[arg-type]
            except ValueError as err:
                part = "gate/up" if which == "w13" else "down"
                raise ValueError(f"experts.{e}.{part}_proj: {err}") from None
        if any(len(ws) > 1 for ws in per_expert):  # every expert's parts apart, so they stack
            rows = _part_rows(slot)  # type: ignore[arg-type]
            per_expert = [ws if len(ws) > 1 else _split_rows(ws[0], rows, [ws[0].g_idx] * len(rows)) for ws in per_expert]
        out.append([_stack([ws[i] for ws in per_expert]) for i in range(len(per_expert[0]))])
    for name in [n for n in experts._parameters if n.startswith(("w13", "w2"))]:
        delattr(experts, name)
    return out[0], out[1]


def _stack(weights: list[QuantWeight]) -> QuantWeight:
    first = weights[0]
    if any(w.g_idx is not None for w in weights):  # some experts in act order: every one gets a g_idx
        for w in weights:
            if w.g_idx is None:
                w.g_idx = (torch.arange(w.in_features, device=w.qweight.device) // w.group_size).to(torch.int32)

    def stack(name: str) -> torch.Tensor | None:
        ts = [getattr(w, name) for w in weights]
        return None if ts[0] is None else torch.stack(ts)

    qweight = stack("qweight")
    assert qweight is not None
    input_scale = stack("input_scale")
    return QuantWeight(first.kind, (first.shape[0], first.shape[1]), qweight, bits=first.bits, scales=stack("scales"),
                       zeros=stack("zeros"), group_size=first.group_size, g_idx=stack("g_idx"), act=first.act,
                       input_scale=None if input_scale is None else input_scale.max().reshape(1), method=first.method,
                       block=first.block, act_group=first.act_group)


def _loader(layer: LinearBase, spec: CkptParam, qc: QuantConfig, groups_sliced: bool) -> Callable[..., None]:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if spec.integer and loaded.dtype != spec.dtype:
            raise ValueError(f"{spec.name} is stored as {loaded.dtype}, expected {spec.dtype}")
        if not spec.integer and not loaded.is_floating_point():
            raise ValueError(f"{spec.name} is stored as {loaded.dtype}, expected a floating-point tensor")
        key, dst, t = shard_id, param.data, loaded
        if getattr(layer, "stacked", False):  # an expert's part (e, part) of a stacked expert weight
            e, shard_id = cast(tuple[int, str], shard_id)
            dst = dst[e]
        if spec.per_part:  # this part's row (a g_idx row is then cut to this rank's input columns below)
            dst = dst[layer.part_index(shard_id)]
        if spec.per_part and spec.in_dim is None:
            t = t.reshape(dst.shape) if t.numel() == dst.numel() else t
        else:
            if spec.out_dim is not None:
                d0, s0, n = layer.out_partition(shard_id)
                p = spec.out_pack
                if d0 % p or s0 % p or n % p:
                    raise ValueError(f"{spec.name}: {n} output rows do not pack {p} to an int32")
                if t.shape[spec.out_dim] * p != layer.checkpoint_rows(shard_id):
                    raise ValueError(f"{spec.name} has shape {tuple(loaded.shape)}: {t.shape[spec.out_dim]} x {p} "
                                     f"output rows, expected {layer.checkpoint_rows(shard_id)}")
                t = t.narrow(spec.out_dim, s0 // p, n // p)
                dst = dst.narrow(spec.out_dim, d0 // p, n // p)
            cols = layer.in_partition()
            if spec.in_dim is not None and cols is not None and (spec.in_unit != "group" or groups_sliced):
                unit = qc.group_size if spec.in_unit == "group" else int(spec.in_unit)
                start, size = cols
                full = size * getattr(layer, "tp_size", 1)
                if start % unit or size % unit or t.shape[spec.in_dim] != full // unit:
                    raise ValueError(f"{spec.name} has shape {tuple(loaded.shape)}: {full} input columns in units of "
                                     f"{unit} do not split evenly over the ranks")
                t = t.narrow(spec.in_dim, start // unit, size // unit)
        if tuple(dst.shape) != tuple(t.shape):
            raise ValueError(f"{spec.name} has shape {tuple(loaded.shape)}, which does not fit {tuple(dst.shape)} "
                             f"({qc.describe()}; a wrong packing, group size or shard)")
        dst.copy_(t)
        param.loaded_parts.add(key)  # type: ignore[attr-defined]

    return load


# ---- conversion to the canonical layout ----------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words holding 32/bits codes each (element i at bits [i*bits, (i+1)*bits)) along
    `dim` -> the unsigned codes (int32), `dim` grown 32/bits times; `order`: element i of a word
    is position order[i] (AWQ)."""
    pf, mask = 32 // bits, (1 << bits) - 1
    # as unsigned 32-bit values in int64: a right shift of a negative number is not the same
    # everywhere (XLA rounds it toward zero)
    x = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(x >> s) & mask for s in range(0, 32, bits)], dim=-1).to(torch.int32)  # [..., words, pf]
    if order is not None:
        codes = codes[..., [order.index(j) for j in range(pf)]]
    return codes.flatten(-2).movedim(-1, dim)


def _trivial_g_idx(g_idx: torch.Tensor, group_size: int, start: int) -> bool:
    expected = (torch.arange(g_idx.numel(), device=g_idx.device) + start) // group_size
    return torch.equal(g_idx.long(), expected)


def _expand_parts(layer: LinearBase, per_part: torch.Tensor) -> torch.Tensor:
    """One value per fused part [P, 1] -> per output row [N, 1]."""
    sizes = [layer.out_partition(s)[2] for s in (layer.parts or [None])]
    return torch.cat([per_part[i].reshape(1, 1).expand(n, 1) for i, n in enumerate(sizes)])


def _part_rows(layer: LinearBase) -> list[tuple[int, int]]:
    """(first row in this rank's weight, rows) of each fused part, in ``layer.parts`` order."""
    return [(d0, n) for d0, _, n in (layer.out_partition(s) for s in layer.parts or [None])]


def _split_rows(w: QuantWeight, rows: list[tuple[int, int]], orders: list[torch.Tensor | None]) -> list[QuantWeight]:
    """`w` cut into one weight per fused part (rows [d0, d0 + n) of it, output order), part i
    with act order ``orders[i]``."""
    def cut(t: torch.Tensor | None, d0: int, n: int) -> torch.Tensor | None:
        return None if t is None else t.narrow(-2, d0, n).clone()

    return [QuantWeight(w.kind, (n, w.in_features), cast(torch.Tensor, cut(w.qweight, d0, n)), bits=w.bits,
                        scales=cut(w.scales, d0, n), zeros=cut(w.zeros, d0, n), group_size=w.group_size, g_idx=g,
                        act=w.act, input_scale=w.input_scale, method=w.method)
            for (d0, n), g in sorted(zip(rows, orders, strict=True), key=lambda r: r[0][0])]


def to_quant_weights(layer: LinearBase, qc: QuantConfig) -> list[QuantWeight]:
    """The canonical `QuantWeight` of a loaded layer (its checkpoint tensors, or for an online
    method its dense weight), or, for a fused layer whose parts' act orders differ, one per part
    in output order (see the module docstring); raises ValueError when the tensors contradict
    each other."""
    n, k = layer.out_local, layer.in_local
    gs = qc.group_size if qc.group_size > 0 else k
    get: Callable[[str], Any] = layer.get_parameter

    def codes(t: torch.Tensor) -> torch.Tensor:  # unsigned codes [N, K] -> canonical storage
        if t.min() < 0 or t.max() >= 1 << qc.bits:
            raise ValueError(f"codes outside [0, {1 << qc.bits})")
        c = t.to(torch.uint8)
        if qc.bits == 4:
            if k % 2:
                raise ValueError(f"4-bit weights need an even number of input features, got {k}")
            return pack_int4(c)
        return c.contiguous()

    def act_order(g_idx: torch.Tensor) -> torch.Tensor | None:
        cols = layer.in_partition()
        start = cols[0] if cols is not None else 0
        if _trivial_g_idx(g_idx, gs, start if not qc.desc_act else 0):
            return None
        if not qc.desc_act:
            raise ValueError("g_idx is not in order but the config says desc_act: false")
        return g_idx.to(torch.int32).contiguous()  # under row parallelism it indexes every group (`_groups`)

    def act_orders(param: Any) -> list[torch.Tensor | None]:  # [parts, K]: each part's g_idx (None: in order)
        loaded = param.loaded_parts
        return [act_order(param[i]) if s in loaded or None in loaded else None for i, s in enumerate(layer.parts or [None])]

    def weight(kind: str, qweight: torch.Tensor, **kw: Any) -> QuantWeight:
        return QuantWeight(kind, (n, k), qweight, group_size=gs, method=qc.method, act=qc.act, **kw)

    def ordered(kind: str, qweight: torch.Tensor, orders: list[torch.Tensor | None], **kw: Any) -> list[QuantWeight]:
        if all(g is None for g in orders):
            return [weight(kind, qweight, **kw)]
        natural = (torch.arange(k, device=qweight.device) // gs).to(torch.int32)
        filled = [natural if g is None else g for g in orders]
        if all(torch.equal(g, filled[0]) for g in filled[1:]):  # the fused parts agree: one weight, one g_idx
            return [weight(kind, qweight, g_idx=filled[0], **kw)]
        return _split_rows(weight(kind, qweight, **kw), _part_rows(layer), orders)

    if qc.method == "gptq":
        q = unpack_int32(get("qweight"), qc.bits, 0).T  # [N, K]
        z = unpack_int32(get("qzeros"), qc.bits, 1).T.float() + (1 if qc.gptq_v1_zeros else 0)  # [N, G]
        return ordered("int", codes(q), act_orders(get("g_idx")), bits=qc.bits, scales=get("scales").T.contiguous(),
                       zeros=z.contiguous())
    if qc.method == "awq":
        q = unpack_int32(get("qweight"), 4, 1, AWQ_ORDER).T
        z = unpack_int32(get("qzeros"), 4, 1, AWQ_ORDER).T.float()
        return [weight("int", codes(q), bits=4, scales=get("scales").T.contiguous(), zeros=z.contiguous())]
    if qc.method == "compressed-tensors" and qc.ct_format == "pack-quantized":
        full_k = k * (getattr(layer, "tp_size", 1) if layer.in_partition() is not None else 1)
        for _, cols in get("weight_shape").tolist():
            if cols != full_k:
                raise ValueError(f"weight_shape says {cols} input features, the model has {full_k}")
        q = unpack_int32(get("weight_packed"), qc.bits, 1)[:, :k]
        zp = unpack_int32(get("weight_zero_point"), qc.bits, 0)[:n].float().contiguous() if not qc.sym else None
        orders: list[torch.Tensor | None] = act_orders(get("weight_g_idx")) if qc.desc_act else [None]
        return ordered("int", codes(q), orders, bits=qc.bits, scales=get("weight_scale").contiguous(), zeros=zp)
    if qc.block is not None:
        block_scale = get("weight_scale_inv" if qc.method == "fp8" else "weight_scale")
        return [QuantWeight("fp8", (n, k), get("weight").detach(), scales=block_scale.detach().float().contiguous(),
                            group_size=qc.block[1], method=qc.method, block=qc.block, act=qc.act, act_group=qc.act_group)]
    if qc.online:
        return [quantize_per_channel(layer.weight.detach(), qc.method, qc.act)]  # type: ignore[union-attr]
    # compressed-tensors int/float-quantized, fp8
    w: torch.Tensor = get("weight")
    scale: torch.Tensor = get("weight_scale")
    scale = _expand_parts(layer, scale) if qc.strategy == "tensor" else scale
    input_scale = get("input_scale").max().reshape(1) if qc.act_static else None
    if w.dtype == torch.float8_e4m3fn:
        return [weight("fp8", w.detach(), scales=scale.contiguous(), input_scale=input_scale)]
    q = (w.detach().to(torch.int16) + 128).to(torch.uint8)
    return [weight("int", q, bits=8, scales=scale.contiguous(), input_scale=input_scale)]
