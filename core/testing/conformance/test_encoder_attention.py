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

Encoder-only models (BERT, ModernBERT) call it through `ForwardContext.encoder_attention`, one
sequence per whole prompt; ModernBERT's local layers add the encoder feature ``sliding_window``
(a query sees the keys at most W positions away), which a backend takes where it lists it in
`AttentionBackend.encoder_features` (core's reference runs it otherwise). The window cases run that
path on the mixed set with windows 0 (each token itself), 3 and 40 (wider than most sequences),
head size 64.
"""

from __future__ import annotations

import pytest
import torch

from portside.attention.reference import encoder_attention
from portside.contract import AttentionMetadata, ForwardContext, Platform
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


WINDOWS = (0, 3, 40)


def _prompt_context(backend, lengths: tuple[int, ...], device: torch.device) -> ForwardContext:  # type: ignore[no-untyped-def]
    """A step of whole prompts of `lengths`, no cache: what an encoder-only model's layers get."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    md = AttentionMetadata(
        slot_mapping=torch.full((bounds[-1],), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(bounds, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(lengths), 1), dtype=torch.int32, device=device),
        max_query_len=max(lengths), max_seq_len=max(lengths), block_size=16,
        query_start_loc_cpu=bounds, seq_lens_cpu=list(lengths),
    )
    return ForwardContext(backend, [], md)


@pytest.mark.parametrize("window", WINDOWS, ids=[f"encoder-window-{w}" for w in WINDOWS])
def test_encoder_attention_window_matches_reference(conformance_platform: type[Platform], window: int) -> None:
    lengths, d = SEQUENCE_SETS["mixed"], 64
    platform = conformance_platform
    device = platform.device(0)
    cu = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    gen = torch.Generator().manual_seed(window)
    for dtype in platform.supported_dtypes:
        backend = platform.attention_backend(engine_config(platform, dtype, platform.default_block_size))
        route = "its own" if "sliding_window" in backend.encoder_features else "core's reference"
        where = f"{backend.name} encoder attention ({route}), window {window}, lengths {list(lengths)}, {dtype}"
        q, k, v = (torch.randn(sum(lengths), NUM_HEADS, d, generator=gen).to(dtype) for _ in range(3))
        ctx = _prompt_context(backend, lengths, device)
        with platform.inference_mode():
            out = ctx.encoder_attention(q.to(device), k.to(device), v.to(device), d**-0.5, sliding_window=window)
        platform.synchronize()
        want = encoder_attention(q.float(), k.float(), v.float(), cu, max(lengths), d**-0.5, sliding_window=window)
        if out.shape != want.shape or out.dtype != dtype:
            contract_failure("encoder-attention", f"returned {tuple(out.shape)} {out.dtype}; expected "
                             f"{tuple(want.shape)} {dtype} ({where})")  # fmt: skip
        got = out.cpu().float()
        tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
        err = (got - want).abs()
        bad = ~(err <= tol["atol"] + tol["rtol"] * want.abs())
        if bad.any():
            contract_failure("encoder-attention", f"output differs from core's reference ({where}): {int(bad.sum())} "
                             f"of {bad.numel()} elements out of tolerance {tol}, max abs err {err.max().item():.3e}")
