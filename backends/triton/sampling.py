"""Structured output's grammar mask for the sampler as a Triton kernel (cuda / rocm).

The contract of core's `portside.sample.bitmask.apply_token_bitmask`: a copy of the fp32 logits
[N, V] in which row `rows[i]` keeps only the tokens whose bit is set in `bitmask[i]` ([M, W]
int32) and every token past 32 * W is -inf. One program per (listed row, BLOCK tokens): it
loads the BLOCK / 32 words it covers once and stores -inf where a bit is clear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _token_bitmask_kernel(out_ptr, bitmask_ptr, rows_ptr, vocab, words, out_stride, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i)
    in_vocab = offs < vocab
    word_idx = offs // 32
    word = tl.load(bitmask_ptr + i * words + word_idx, mask=in_vocab & (word_idx < words), other=0)
    allowed = ((word >> (offs % 32)) & 1) != 0
    tl.store(out_ptr + row * out_stride + offs, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.float().contiguous().clone()
    m = rows.shape[0]
    if m == 0:
        return out
    vocab = out.shape[1]
    bitmask = bitmask.to(device=out.device, dtype=torch.int32).contiguous()
    rows = rows.to(device=out.device, dtype=torch.int64).contiguous()
    grid = (m, triton.cdiv(vocab, BLOCK))
    _token_bitmask_kernel[grid](out, bitmask, rows, vocab, bitmask.shape[1], out.stride(0), BLOCK=BLOCK)
    return out
