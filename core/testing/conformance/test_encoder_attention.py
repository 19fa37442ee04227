"""Encoder attention contract: the platform's `AttentionBackend.encoder_attention` (non-causal
attention within each packed sequence, no KV cache: vision towers) equals core's reference
(`portside.attention.reference.encoder_attention`) at every declared dtype.

Sequence sets (lengths, back to back in one packed batch), as vision-language models make them:
a 1-token sequence alone; one image; Qwen2.5-VL-like windows (several sequences of one length
plus a shorter edge window); and a mix of lengths 1, 7, 16, 64 and 100 in shuffled order. Head
sizes 64 and 80 (not a power of two: Qwen2.5-VL's vision tower), 4 heads. The mixed set is run
twice: with contiguous q, k, v and with q, k, v as strided views of one fused [T, 3, H, D]
projection, as a model's qkv split hands them over. The reference runs in fp32 on the same
rounded inputs; tolerances are the dtype table (`portside.testing.tolerances.TOLERANCES`). The
output must be [T, H, D] in the query's dtype, on the query's device, and the inputs unchanged.

A backend that does not override `encoder_attention` runs the reference itself and passes.
"""

from __future__ import annotations

import pytest
import torch

from portside.attention.reference import encoder_attention
from portside.contract import Platform
from portside.testing.conformance.cases import contract_failure, engine_config
from portside.testing.tolerances import TOLERANCES

NUM_HEADS = 4
HEAD_SIZES = (64, 80)
SEQUENCE_SETS: dict[str, tuple[int, ...]] = {
    "one_token": (1,),
    "one_image": (50,),
    "windows": (16, 16, 16, 16, 7),
    "mixed": (7, 100, 1, 64, 16),
}
CASES = [(name, d, "contiguous") for name in SEQUENCE_SETS for d in HEAD_SIZES] + [
    ("mixed", d, "fused_qkv") for d in HEAD_SIZES
]


def _inputs(packed: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v from one [T, 3, H, D] tensor: strided views of it (a fused qkv projection), or
    contiguous copies."""
    q, k, v = packed[:, 0], packed[:, 1], packed[:, 2]  # row stride 3 * H * D
    if layout == "fused_qkv":
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()


@pytest.mark.parametrize("case", CASES, ids=[f"encoder-{n}-d{d}-{lay}" for n, d, lay in CASES])
def test_encoder_attention_matches_reference(conformance_platform: type[Platform], case) -> None:  # type: ignore[no-untyped-def]
    name, d, layout = case
    lengths = SEQUENCE_SETS[name]
    platform = conformance_platform
    device = platform.device(0)
    cu = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale = d**-0.5
    gen = torch.Generator().manual_seed(sum(lengths) * 100 + d)
    for dtype in platform.supported_dtypes:
        backend = platform.attention_backend(engine_config(platform, dtype, platform.default_block_size))
        where = (
            f"{backend.name}.encoder_attention, lengths {list(lengths)}, {NUM_HEADS} heads of {d}, {layout}, {dtype}"
        )
        packed = torch.randn(sum(lengths), 3, NUM_HEADS, d, generator=gen).to(dtype)
        q, k, v = _inputs(packed, layout)
        qd, kd, vd = _inputs(packed.to(device), layout)
        before = [x.cpu().clone() for x in (qd, kd, vd)]
        with platform.inference_mode():
            out = backend.encoder_attention(qd, kd, vd, cu.to(device), max(lengths), scale)
        platform.synchronize()
        want = encoder_attention(q.float(), k.float(), v.float(), cu, max(lengths), scale).to(dtype)
        if out.shape != want.shape or out.dtype != dtype or out.device.type != qd.device.type:
            contract_failure("encoder-attention", f"returned {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                             f"{tuple(want.shape)} {dtype} on {qd.device} ({where})")  # fmt: skip
        if any(not torch.equal(x.cpu(), b) for x, b in zip((qd, kd, vd), before)):
            contract_failure("encoder-attention", f"modified its query, key or value ({where})")
        got = out.cpu().float()
        tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
        err = (got - want.float()).abs()
        bad = ~(err <= tol["atol"] + tol["rtol"] * want.float().abs())  # NaN counts as bad
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            seq = int(torch.searchsorted(cu, torch.tensor([row], dtype=torch.int32), right=True)[0]) - 1
            contract_failure("encoder-attention", f"output differs from core's reference ({where}): {int(bad.sum())} "
                             f"of {bad.numel()} elements out of tolerance {tol}, max abs err {err.max().item():.3e}; "
                             f"first bad token {row} (sequence {seq} of length {lengths[seq]})")  # fmt: skip
