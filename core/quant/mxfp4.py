"""MXFP4 mixture-of-experts checkpoints (``quant_method: mxfp4``: OpenAI's gpt-oss), kept in their
blocks: every expert weight is e2m1 codes with one e8m0 scale per 32 input columns.

The checkpoint stores an MoE layer's experts fused, as transformers' ``GptOssExperts`` names them:
``mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, hidden / 32, 16] and ``..._scales`` uint8
[E, 2I, hidden / 32] (rows interleaved: row 2i is gate row i, 2i + 1 up row i),
``mlp.experts.down_proj_blocks`` [E, hidden, I / 32, 16] and ``..._scales`` [E, hidden, I / 32].
Byte j of a block holds column 2j in its low nibble and 2j + 1 in its high one, which is the
canonical ``mxfp4`` `QuantWeight` layout once a row's blocks are flattened ([.., N, K / 2]).

`add_expert_params` gives an experts module (`portside.model.moe.MoEExperts`, or one with its
attributes: ``num_experts``, ``hidden_size``, ``local``, ``tp_rank``, ``tp_size`` and the dense
``w13`` / ``w2``) those four tensors under the checkpoint's names in place of w13 / w2, each
loader taking this rank's slice: gate and up rows de-interleaved into portside's order (gate
rows, then up rows) and cut to the rank's intermediate rows; down's columns cut in whole blocks of
32 (an intermediate size per rank that is not a multiple of 32 is refused). `expert_weights`
turns them into the stacked (w13, w2) `QuantWeight`s without copying the codes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.quant.weight import FP4_VALUES, QuantWeight

__all__ = ["EXPERT_TENSORS", "add_expert_params", "expert_weights", "is_experts", "quantize_mxfp4", "mxfp4_weight"]

BLOCK = 32
# checkpoint tensor (under the experts module) -> (which of w13 / w2, blocks or scales)
EXPERT_TENSORS = {"gate_up_proj_blocks": ("w13", "blocks"), "gate_up_proj_scales": ("w13", "scales"),
                  "down_proj_blocks": ("w2", "blocks"), "down_proj_scales": ("w2", "scales")}


def is_experts(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("num_experts", "hidden_size", "local", "tp_rank", "tp_size", "w13", "w2"))


def _loader(experts: Any, which: str, interleaved: bool) -> Any:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dtype != torch.uint8:
            raise ValueError(f"mxfp4 {which} tensors are stored as {loaded.dtype}, expected uint8")
        if shard_id is not None:
            raise ValueError("mxfp4 experts are read from the fused gate_up_proj / down_proj tensors")
        e, local, r = experts.num_experts, experts.local, experts.tp_rank
        dst = param.data
        want = (e, 2 * local * experts.tp_size if which == "w13" else experts.hidden_size, *dst.shape[2:])
        if which == "w2":
            want = (e, experts.hidden_size, dst.shape[2] * experts.tp_size, *dst.shape[3:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {want} (an mxfp4 tensor of the experts' "
                             f"{'gate_up' if which == 'w13' else 'down'}_proj in blocks of {BLOCK})")
        if which == "w13":
            gate, up = (loaded[:, 0::2], loaded[:, 1::2]) if interleaved else loaded.chunk(2, dim=1)
            dst[:, :local].copy_(gate.narrow(1, r * local, local))
            dst[:, local:].copy_(up.narrow(1, r * local, local))
        else:
            blocks = dst.shape[2]
            dst.copy_(loaded.narrow(2, r * blocks, blocks))

    return load


def add_expert_params(experts: Any, interleaved: bool = True) -> None:
    """Replace `experts`' dense w13 / w2 with the checkpoint's MXFP4 blocks and scales (this
    rank's slice); `interleaved`: gate and up rows alternate in the checkpoint (gpt-oss)."""
    hidden, local = experts.hidden_size, experts.local
    if hidden % BLOCK or local % BLOCK:
        raise ValueError(f"mxfp4 experts need hidden size ({hidden}) and intermediate size per rank ({local}) in whole "
                         f"blocks of {BLOCK}; use a tensor-parallel size that keeps them so")
    e = experts.num_experts
    shapes = {"gate_up_proj_blocks": (e, 2 * local, hidden // BLOCK, BLOCK // 2), "gate_up_proj_scales": (e, 2 * local, hidden // BLOCK),
              "down_proj_blocks": (e, hidden, local // BLOCK, BLOCK // 2), "down_proj_scales": (e, hidden, local // BLOCK)}
    del experts.w13, experts.w2
    for name, (which, _) in EXPERT_TENSORS.items():
        p = nn.Parameter(torch.zeros(shapes[name], dtype=torch.uint8), requires_grad=False)
        p.weight_loader = _loader(experts, which, interleaved)  # type: ignore[attr-defined]
        experts.register_parameter(name, p)
    experts.quant_format = "mxfp4"


def _reshaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t`'s storage seen as `shape`, as a tensor of its own: a view would keep `t` alive as its
    ``_base`` after the platform moves the weight's data elsewhere (the cpu backend packs every
    weight into one buffer), and with it the storage the codes were loaded into."""
    assert t.is_contiguous()
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), shape, strides)


def expert_weights(experts: Any) -> tuple[QuantWeight, QuantWeight]:
    """The loaded experts' (w13 [E, 2I, hidden], w2 [E, hidden, I]) as canonical ``mxfp4``
    `QuantWeight`s (the codes' storage as loaded); the checkpoint parameters are removed."""
    e, hidden, local = experts.num_experts, experts.hidden_size, experts.local
    p = {name: experts.get_parameter(name).data for name in EXPERT_TENSORS}
    w13 = QuantWeight("mxfp4", (2 * local, hidden), _reshaped(p["gate_up_proj_blocks"], (e, 2 * local, hidden // 2)), bits=4,
                      scales=p["gate_up_proj_scales"], group_size=BLOCK, method="mxfp4")
    w2 = QuantWeight("mxfp4", (hidden, local), _reshaped(p["down_proj_blocks"], (e, hidden, local // 2)), bits=4,
                     scales=p["down_proj_scales"], group_size=BLOCK, method="mxfp4")
    for name in EXPERT_TENSORS:
        delattr(experts, name)
    experts.quant_format = None
    return w13, w2


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each value of x (|x| <= 6; a tie goes to the smaller magnitude)."""
    mags = torch.tensor(FP4_VALUES[:8], device=x.device)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    return (idx | ((x < 0).long() << 3)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] (K a multiple of 32) rounded to MXFP4 as a checkpoint stores it: (blocks
    uint8 [.., N, K / 32, 16], scales uint8 e8m0 [.., N, K / 32]); each block of 32 scaled by the
    power of two that brings its absolute maximum to at most 6, then each value to the nearest
    e2m1 one (tests and checkpoint writers; not on any serving path)."""
    *lead, n, k = w.shape
    g = w.float().reshape(*lead, n, k // BLOCK, BLOCK)
    amax = g.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    codes = _e2m1_codes((g / torch.exp2(exp).unsqueeze(-1)).clamp(-6, 6))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_weight(w: torch.Tensor) -> QuantWeight:
    """A dense [.., N, K] weight as a canonical ``mxfp4`` `QuantWeight` (tests, conformance)."""
    blocks, scales = quantize_mxfp4(w)
    n, k = w.shape[-2], w.shape[-1]
    return QuantWeight("mxfp4", (n, k), blocks.flatten(-2), bits=4, scales=scales, group_size=BLOCK, method="mxfp4")
