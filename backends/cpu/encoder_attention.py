"""Non-causal encoder attention on CPUs (`AttentionBackend.encoder_attention`): torch's
`scaled_dot_product_attention` over sequences batched by length.

Sequences of one length are attended in one SDPA call, [n, H, L, D]: a run of consecutive
sequences of that length is a view of the packed rows (no copy); other sequences of the length
are gathered (`index_select`) and their outputs scattered back (`index_copy_`). Vision towers
give few distinct lengths (one per image size; Qwen2.5-VL's windows are mostly full), so a step
is a handful of SDPA calls instead of one per sequence, and no key is ever padded or masked.

Numerics: fp32 math, output rounded once to the query's dtype, as the reference. fp16/bf16 are
upcast to fp32 for SDPA unless the CPU multiplies that dtype natively (bf16: AVX-512-BF16 or AMX,
`host.has_native_bf16`; fp16: AMX-FP16 or AVX512-FP16): SDPA's CPU kernel accumulates in
fp32 either way, but rounds the probabilities to the input dtype before P @ V, and without
native support its half-precision path is slower than the fp32 one (fp16 SDPA on the AVX2 CI
machine: 0.6x the reference's speed, fp32 SDPA on upcast inputs: 1.3-2.9x). Anything SDPA does
not take here (float64, mixed dtypes) goes to the reference.

Measured against the reference (`portside.attention.reference.encoder_attention`) on an AVX2
AMD EPYC, fp32, 2 threads (1 thread): 4 LLaVA images of 577 tokens (16 heads of 64) 1.8x (1.3x);
40 Qwen2.5-VL windows of 64 tokens + 8 of 16 (16 x 80) 1.4x (1.2x); 20 sequences of 1-100 tokens
1.7x (1.4x); 2 SigLIP images of 729 tokens 2.7x (2.5x); bf16 alike. Per-sequence SDPA calls were
slower than the reference (0.8-1.2x), one padded SDPA with key masks 0.4-1.1x.

Encoder-only models (BERT, ModernBERT: `ForwardContext.encoder_attention`) come the same way,
one sequence per prompt; ModernBERT's local layers (``sliding_window``) add one [L, L] band
mask per length, shared by the sequences of that length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portside.backends.cpu.host import cpu_flags, has_native_bf16
from portside.contract import reference_encoder_attention

__all__ = ["band_mask", "encoder_attention", "length_groups", "compute_dtype"]

SDPA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def length_groups(bounds: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Sequence length -> runs ``(first row, number of sequences)`` of consecutive sequences of
    that length, from the host copy of cu_seqlens; empty sequences are dropped."""
    groups: dict[int, list[tuple[int, int]]] = {}
    prev = -1
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        if n <= 0:
            prev = -1
            continue
        runs = groups.setdefault(n, [])
        if prev == n:  # extends the last run of this length (it ends at row a)
            start, count = runs[-1]
            runs[-1] = (start, count + 1)
        else:
            runs.append((a, 1))
        prev = n
    return groups


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What SDPA runs in for inputs of `dtype` on this CPU: the dtype itself where the CPU
    multiplies it natively, else fp32."""
    if dtype == torch.bfloat16 and has_native_bf16():
        return dtype
    if dtype == torch.float16 and cpu_flags() & {"amx_fp16", "avx512_fp16"}:
        return dtype
    return torch.float32


def band_mask(length: int, window: int | None) -> torch.Tensor | None:
    """[L, L] bool, True where query p may see key k (``|p - k| <= window``); None: no window
    (or one that covers the whole sequence)."""
    if window is None or window >= length - 1:
        return None
    pos = torch.arange(length)
    return (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() <= window


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype,
          window: int | None = None) -> torch.Tensor:
    """[n, L, H, D] each -> [n, L, H, D] in `dtype`, computed in `compute_dtype(dtype)`; with
    `window`, each query sees the keys within it (`band_mask`, shared by the n sequences)."""
    mask = band_mask(q.shape[1], window)
    q, k, v = (x.transpose(1, 2).to(compute_dtype(dtype)) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2).to(dtype)


def encoder_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int32
    max_seqlen: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Bidirectional attention within each sequence; [T, H, D] in the query's dtype. With
    `sliding_window` W a query at position p sees the keys at ``|p - k| <= W`` only."""
    if query.dtype not in SDPA_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        # core's reference
        return reference_encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, sliding_window)
    num_tokens, num_heads, head_size = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    bounds = cu_seqlens.tolist()
    groups = length_groups(bounds)
    if len(groups) == 1:
        (length, runs), = groups.items()
        if runs == [(0, num_tokens // length)] and num_tokens % length == 0:
            # every row, one length (a batch of equal prompts): SDPA's [n, L, H, D] output is the answer
            shape = (num_tokens // length, length, num_heads, head_size)
            o = _sdpa(query.view(shape), key.view(shape), value.view(shape), scale, query.dtype, sliding_window)
            return o.reshape(num_tokens, num_heads, head_size)
    for length, runs in groups.items():
        count = sum(n for _, n in runs)
        if len(runs) == 1:  # one run: views of the packed rows, no copy
            a, n = runs[0]
            rows = slice(a, a + n * length)
            shape = (n, length, num_heads, head_size)
            o = _sdpa(query[rows].view(shape), key[rows].view(shape), value[rows].view(shape), scale, query.dtype,
                      sliding_window)
            out[rows] = o.reshape(n * length, num_heads, head_size)
            continue
        idx = torch.cat([torch.arange(a, a + n * length) for a, n in runs])
        shape = (count, length, num_heads, head_size)
        q, k, v = (x.index_select(0, idx).view(shape) for x in (query, key, value))
        o = _sdpa(q, k, v, scale, query.dtype, sliding_window)
        out.index_copy_(0, idx, o.reshape(count * length, num_heads, head_size))
    return out
