"""Batch-invariant references: kernels whose result for one row (one token) does not depend on
which other rows share the call, how many there are, or how a prompt was split into chunks.
What batch-invariant mode (`EngineConfig.batch_invariant`, ``--batch-invariant``) runs.

The approach is Thinking Machines' ("Defeating Nondeterminism in LLM Inference", as vLLM's
``batch_invariant`` ops adopted it): every reduction a token's result goes through is done in an
order fixed by the model's shapes alone, never by the batch's. Measured on torch 2.13's CPU
kernels (ci/bench/batch_invariant.py prints the same checks):

- matmul: MKL's sgemm sums a row's products in an order that depends on the number of rows (a
  row alone goes through GEMV; 2, 3, 5 and 9 rows through other blockings than 16), so `linear`
  runs every product as calls of exactly `ROW_TILE` rows (zero-padded), each from a fresh
  buffer: every call has the same shape, and a row's result does not depend on its position in
  the tile or on its neighbours (checked by the tests and the bench);
- elementwise functions: torch computes the tail of a tensor (the elements after the last full
  vector, which depend on its size and on how it is split over threads) with scalar code that
  differs from the vector code in the last bit for SiLU, GELU and sigmoid (~4% of fp32 inputs);
  `exp`, `tanh`, `erf`, +, -, *, / give the same bits on both paths, so the activations here are
  written with those only;
- sums: `fixed_sum` adds halves elementwise (a pairwise tree fixed by the length), which no
  thread split or vector width can reorder; torch's own row sums are split over threads when the
  output is one row longer than its grain (32768 elements), so RMSNorm does not use them;
- attention (`paged_attention`): each query's keys are cut into KV blocks of `block_size`
  positions; each block's softmax statistics are computed on their own and merged into the
  query's running ones block after block, in order; blocks past the query's position are masked
  entirely and leave its state bit for bit unchanged, so a query gets the same bits
  whether its prompt came in one chunk or several, alone or beside other requests, with its
  prefix computed now or read from the prefix cache.

A block's products (q . k over head_size, p . v over the block) are `torch.bmm` calls of one
small matrix pair per (query, block, KV head), shapes fixed by the model and the block size: fp32
bmm computes each pair alone, and its results did not change with the number of pairs (1 to 3000,
one and two threads, measured).

Softmax, log_softmax, cumsum, top-k and argmax over the vocabulary (the sampler's) are row-wise
kernels in torch whose per-row order depends on the row's length only (measured for 1 to 300
rows of 576 to 151936 values); a seeded request draws from its own generator (`SamplingMetadata`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ROW_TILE", "activation", "fixed_sum", "gelu", "gelu_tanh", "linear", "paged_attention", "rms_norm", "silu"]

ROW_TILE = 16
"""Rows of every matmul call `linear` makes (a multiple of 16 keeps each tile's bytes 64-byte
aligned for fp32 and bf16 rows)."""


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in an order fixed by its length: zero-padded to a power of two,
    then halves added elementwise until one value is left. [..., n] -> [...]."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N], each row computed by an identical call
    (`ROW_TILE` rows from a fresh, zero-padded buffer) whatever the number of rows."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    padded = -(-rows // ROW_TILE) * ROW_TILE
    buf = x.new_zeros(padded, k)
    buf[:rows] = x.reshape(rows, k)
    # a tile at the same 64-byte alignment as a fresh buffer (GEMM kernels may branch on it); only
    # a tile of an odd number of bf16/fp16 values per row is not, and is copied
    aligned = (ROW_TILE * k * buf.element_size()) % 64 == 0
    tiles = [buf[i : i + ROW_TILE] if aligned else buf[i : i + ROW_TILE].clone() for i in range(0, padded, ROW_TILE)]
    out = torch.cat([F.linear(t, weight, bias) for t in tiles]) if padded else x.new_zeros(0, weight.shape[0])
    return out[:rows].reshape(*lead, weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last axis in fp32 with a `fixed_sum`: Llama's order (normalise in fp32,
    scale in x's dtype), or with `offset` Gemma's (weight stored as an offset from 1, applied
    in fp32)."""
    h = x.float()
    h = h * torch.rsqrt(fixed_sum(h * h) / h.shape[-1] + eps).unsqueeze(-1)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), in fp32, from exp and division only (see the module's note)."""
    h = x.float()
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU, in fp32."""
    h = x.float()
    return (0.5 * h * (1.0 + torch.erf(h * 0.7071067811865476))).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated GELU, in fp32."""
    h = x.float()
    return (0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)))).to(x.dtype)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The invariant activation for a config's ``hidden_act``."""
    table = {"silu": silu, "gelu": gelu, "gelu_pytorch_tanh": gelu_tanh, "gelu_tanh": gelu_tanh}
    if name not in table:
        raise ValueError(f"batch-invariant mode has no activation {name!r}; it supports {sorted(table)}")
    return table[name]


_CHUNK_FLOATS = 1 << 19  # bounds one piece's [queries, keys, heads, head_size] products (2 MiB: in cache)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    keys: torch.Tensor,  # [R, S, KVH, D]: request r's positions 0..S-1 (zero past its sequence)
    values: torch.Tensor,  # [R, S, KVH, D]
    query_req: torch.Tensor,  # [T] int64: each query's request
    query_pos: torch.Tensor,  # [T] int64: each query's position in its sequence
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention in fp32 -> [T, H, D] fp32. Each query's keys are cut into blocks of
    `block_size` positions; each block's softmax statistics (its max, its sum of exponentials (a
    `fixed_sum`) and their weighted sum of values, the scores and that sum one fixed-shape `bmm`
    pair per query, block and KV head) are computed on their own, then merged into the query's running ones block after block, in order. A query's
    result depends only on its own keys, values and position: a block past its position (or before
    its window) is masked entirely and leaves its state bit for bit unchanged, so neither the
    batch's longest sequence nor how the queries are grouped into calls or pieces matters. With
    `sliding_window` W a query at p sees p - W < k <= p; with `logit_softcap` c scores become
    c * tanh(s / c) before the mask."""
    T, H, D = query.shape
    R, S, KVH, _ = keys.shape
    G, B = H // KVH, block_size
    out = query.new_zeros(T, H, D, dtype=torch.float32)
    if T == 0:
        return out
    qf = query.float().reshape(T, KVH, G, D)
    blocks = -(-S // B)
    pad = blocks * B - S
    kf, vf = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).view(R, blocks, B, KVH, D) for t in (keys, values))
    # pieces of queries x blocks whose products fit in _CHUNK_FLOATS (the pieces change the speed,
    # never the bits)
    per_block = B * H * D
    chunk = max(1, _CHUNK_FLOATS // per_block)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        req, pos = query_req[t0:t1], query_pos[t0:t1]
        C = t1 - t0
        q = qf[t0:t1]
        group = max(1, _CHUNK_FLOATS // (C * per_block))
        m = q.new_full((C, KVH, G), float("-inf"))
        den = q.new_zeros(C, KVH, G)
        acc = q.new_zeros(C, KVH, G, D)
        last = int(pos.max()) // B
        first = 0 if sliding_window is None else max(0, (int(pos.min()) - sliding_window + 1) // B)
        for j0 in range(first, last + 1, group):
            j1 = min(last + 1, j0 + group)
            n = j1 - j0
            kpos = torch.arange(j0 * B, j1 * B, device=query.device).view(n, B)  # [n, B]
            # one small product per (query, block, KV head), shapes fixed by the model; every operand
            # made contiguous: MKL picks its kernel (and so its sum order) by the strides too, and a
            # reshape of a lone query or block is a strided view where a batch's is a copy
            rows = C * n * KVH
            kb = kf[:, j0:j1].index_select(0, req).permute(0, 1, 3, 4, 2).reshape(rows, D, B).contiguous()
            vb = vf[:, j0:j1].index_select(0, req).permute(0, 1, 3, 2, 4)  # [C, n, KVH, B, D]
            qb = q[:, None].expand(C, n, KVH, G, D).reshape(rows, G, D).contiguous()
            s = torch.bmm(qb, kb).view(C, n, KVH, G, B) * scale
            if logit_softcap is not None:
                s = logit_softcap * torch.tanh(s / logit_softcap)
            visible = kpos[None] <= pos[:, None, None]  # [C, n, B]
            if sliding_window is not None:
                visible &= kpos[None] > pos[:, None, None] - sliding_window
            hidden = ~visible[:, :, None, None]  # [C, n, 1, 1, B]
            s = s.masked_fill(hidden, float("-inf"))
            bm = s.amax(-1)  # [C, n, KVH, G]: each block's max (-inf: nothing visible)
            bshift = bm.masked_fill(bm == float("-inf"), 0.0)
            p = torch.exp(s - bshift[..., None])  # [C, n, KVH, G, B]; 0 where hidden
            bden = fixed_sum(p)  # [C, n, KVH, G]
            vb = vb.masked_fill(hidden.transpose(-1, -2), 0.0).reshape(rows, B, D).contiguous()
            bacc = torch.bmm(p.reshape(rows, G, B).contiguous(), vb).view(C, n, KVH, G, D)
            for j in range(n):  # merge in block order
                m_new = torch.maximum(m, bm[:, j])
                shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
                alpha, beta = torch.exp(m - shift), torch.exp(bm[:, j] - shift)
                den = den * alpha + bden[:, j] * beta
                acc = acc * alpha[..., None] + bacc[:, j] * beta[..., None]
                m = m_new
        out[t0:t1] = (acc / den[..., None]).reshape(C, H, D)
    return out
