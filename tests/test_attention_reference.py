"""Core's attention references with the per-layer features (sliding window, logit softcap) against
independent dense computations; the read_kv fallback on a backend with its own cache layout;
`ForwardContext.attention`'s dispatch between a backend's `forward` and that fallback; and the
non-causal encoder attention against one dense SDPA under a block-diagonal mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from portside.attention.reference import (
    ReferenceAttentionBackend,
    attend,
    attention_through_read_kv,
    encoder_attention,
    paged_attention,
    write_kv,
)
from portside.contract import AttentionBackend, ForwardContext
from portside.testing.conformance.cases import (
    FEATURE_SETS,
    build_metadata,
    feature_batches,
    feature_settings,
    ordered,
    random_block_tables,
)
from portside.testing.tolerances import TOLERANCES

H, KVH, D = 8, 2, 16
SCALE = D**-0.5


def sdpa(q, k, v, scale, window=None):
    """Causal (optionally windowed) attention of the last Q positions, by torch SDPA with an
    explicit mask, in float64."""
    q_len, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - (window or seq_len + 1))
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def loop_attention(q, k, v, scale, window=None, softcap=None):
    """The semantics written out one query and head at a time, in Python floats."""
    q_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q_len):
        p = seq_len - q_len + j
        keys = [i for i in range(p + 1) if window is None or i > p - window]
        for h in range(q.shape[1]):
            scores = [scale * float(q[j, h].double() @ k[i, h // group].double()) for i in keys]
            if softcap is not None:
                scores = [softcap * math.tanh(s / softcap) for s in scores]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[j, h] = sum(w / total * v[i, h // group].double() for w, i in zip(weights, keys))
    return out


def qkv(q_len, seq_len, gen, heads=H, kv_heads=KVH, d=D):
    return (torch.randn(q_len, heads, d, generator=gen), torch.randn(seq_len, kv_heads, d, generator=gen),
            torch.randn(seq_len, kv_heads, d, generator=gen))  # fmt: skip


@pytest.mark.parametrize("window", [None, 1, 2, 5, 11, 12, 100])
@pytest.mark.parametrize("q_len", [1, 4, 12])
def test_attend_sliding_window_matches_sdpa(window, q_len):
    q, k, v = qkv(q_len, 12, torch.Generator().manual_seed(q_len))
    torch.testing.assert_close(attend(q, k, v, SCALE, sliding_window=window), sdpa(q, k, v, SCALE, window).float())


@pytest.mark.parametrize("softcap", [0.5, 2.0, 50.0])
@pytest.mark.parametrize("window", [None, 3])
def test_attend_logit_softcap_matches_the_formula(softcap, window):
    q, k, v = qkv(5, 9, torch.Generator().manual_seed(3))
    q = 4 * q  # large scores, so the cap matters
    got = attend(q, k, v, SCALE, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(got, loop_attention(q, k, v, SCALE, window, softcap).float())


def test_softcap_changes_the_result():
    q, k, v = qkv(5, 9, torch.Generator().manual_seed(3))
    assert (attend(q, k, v, SCALE, logit_softcap=1.0) - attend(q, k, v, SCALE)).abs().max() > 1e-2


# ---- paged --------------------------------------------------------------------------------------

BS = 4
REQUESTS = ((9, 1), (0, 1), (3, 1), (0, 7), (5, 3), (8, 6))  # (num_cached, num_new): decodes, prefills, chunks


def paged_batch(gen, requests=REQUESTS, block_size=BS):
    """A mixed batch with scattered block tables: the metadata, every request's whole K/V
    sequence, and the new tokens' q/k/v."""
    requests = ordered(requests)
    pool = 4 * sum(-(-(c + n) // block_size) for c, n in requests)
    tables = random_block_tables(requests, block_size, pool, gen)
    md = build_metadata(requests, tables, block_size, torch.device("cpu"))
    seqs = [qkv(c + n, c + n, gen) for c, n in requests]  # per request: q (only the last n used), k, v
    q = torch.cat([s[0][c:] for s, (c, _) in zip(seqs, requests)])
    k = torch.cat([s[1][c:] for s, (c, _) in zip(seqs, requests)])
    v = torch.cat([s[2][c:] for s, (c, _) in zip(seqs, requests)])
    return md, pool, seqs, (q, k, v), requests


def cached_prefixes(cache, write, md, seqs, requests, block_size=BS):
    """`cache` (noise) with every request's cached prefix stored by `write` (the new tokens not yet)."""
    for i, ((c, _), (_, k, v)) in enumerate(zip(requests, seqs)):
        if c:
            prefix = build_metadata(((0, c),), [md.block_tables[i].tolist()], block_size, torch.device("cpu"))
            write(cache, k[:c], v[:c], prefix.slot_mapping)
    return cache


def canonical_cache(md, pool, seqs, requests, block_size=BS):
    """Core's canonical cache holding every request's cached prefix."""
    return cached_prefixes(torch.randn(2, pool, block_size, KVH, D), write_kv, md, seqs, requests, block_size)


@pytest.mark.parametrize("features", [{}, {"sliding_window": 1}, {"sliding_window": 3}, {"sliding_window": 6},
                                      {"logit_softcap": 1.0}, {"sliding_window": 5, "logit_softcap": 2.0}])  # fmt: skip
def test_paged_attention_features_match_dense(features):
    md, pool, seqs, (q, k, v), requests = paged_batch(torch.Generator().manual_seed(0))
    cache = canonical_cache(md, pool, seqs, requests)
    write_kv(cache, k, v, md.slot_mapping)
    out = paged_attention(q, cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, SCALE, **features)
    window, softcap = features.get("sliding_window"), features.get("logit_softcap")
    for i, ((c, _), (sq, sk, sv)) in enumerate(zip(requests, seqs)):
        rows = slice(md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1])
        want = sdpa(sq[c:], sk, sv, SCALE, window) if softcap is None else loop_attention(sq[c:], sk, sv, SCALE, window, softcap)
        torch.testing.assert_close(out[rows], want.float())


class PermutedBackend(AttentionBackend):
    """A backend with its own cache layout, [num_kv_heads, head_size, 2, num_blocks, block_size],
    and no features: `forward` records its keyword arguments and attends by the fallback."""

    name = "permuted"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (num_kv_heads, head_size, 2, num_blocks, block_size)

    @staticmethod
    def _slots(kv_cache):  # [2, num_blocks * block_size, kvh, D] (a view)
        kvh, d, _, nb, bs = kv_cache.shape
        return kv_cache.view(kvh, d, 2, nb * bs).permute(2, 3, 0, 1)

    def write_kv(self, kv_cache, key, value, slot_mapping):
        keep = slot_mapping >= 0
        view = self._slots(kv_cache)
        view[0, slot_mapping[keep]] = key[keep].to(kv_cache.dtype)
        view[1, slot_mapping[keep]] = value[keep].to(kv_cache.dtype)

    def read_kv(self, kv_cache, slots):
        view = self._slots(kv_cache)
        return view[0, slots.long()], view[1, slots.long()]

    def forward(self, query, key, value, kv_cache, metadata, scale, **features):
        self.calls.append(features)
        return attention_through_read_kv(self, query, key, value, kv_cache, metadata, scale, **features)


def permuted_cache(backend, md, pool, seqs, requests):
    cache = torch.randn(backend.kv_cache_shape(pool, BS, KVH, D))
    return cached_prefixes(cache, backend.write_kv, md, seqs, requests)


@pytest.mark.parametrize("features", [{}, {"sliding_window": 2}, {"sliding_window": 5, "logit_softcap": 1.5}])
def test_fallback_with_a_permuted_layout_equals_paged_attention(features):
    md, pool, seqs, (q, k, v), requests = paged_batch(torch.Generator().manual_seed(1))
    backend = PermutedBackend()
    cache = permuted_cache(backend, md, pool, seqs, requests)
    ref = canonical_cache(md, pool, seqs, requests)
    out = attention_through_read_kv(backend, q, k, v, cache, md, SCALE, **features)
    write_kv(ref, k, v, md.slot_mapping)
    want = paged_attention(q, ref, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, SCALE, **features)
    torch.testing.assert_close(out, want)
    k_back, v_back = backend.read_kv(cache, md.slot_mapping)
    assert torch.equal(k_back, k) and torch.equal(v_back, v)  # the new tokens were stored


# ---- ForwardContext.attention dispatch ------------------------------------------------------------


def dispatch(backend_features, features):
    """ctx.attention(**features) on a PermutedBackend listing `backend_features`: (forward's
    recorded kwargs, the output, paged_attention's output with the non-None features)."""
    md, pool, seqs, (q, k, v), requests = paged_batch(torch.Generator().manual_seed(2))
    backend = PermutedBackend()
    backend.features = frozenset(backend_features)
    cache = permuted_cache(backend, md, pool, seqs, requests)
    out = ForwardContext(backend, [cache], md).attention(0, q, k, v, SCALE, **features)
    ref = canonical_cache(md, pool, seqs, requests)
    write_kv(ref, k, v, md.slot_mapping)
    used = {n: x for n, x in features.items() if x is not None}
    want = paged_attention(q, ref, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, SCALE, **used)
    return backend.calls, out, want


@pytest.mark.parametrize("backend_features, features, forward_gets", [
    ((), {}, [{}]),
    ((), {"sliding_window": None, "logit_softcap": None}, [{}]),  # None: the layer does not use it
    ((), {"sliding_window": 3}, []),  # not listed: the fallback, forward never sees the kwarg
    ((), {"sliding_window": 3, "logit_softcap": 2.0}, []),
    (("sliding_window",), {"sliding_window": 3, "logit_softcap": None}, [{"sliding_window": 3}]),
    (("sliding_window",), {"sliding_window": 3, "logit_softcap": 2.0}, []),  # one not listed: fallback
    (("sliding_window", "logit_softcap"), {"sliding_window": 3, "logit_softcap": 2.0},
     [{"sliding_window": 3, "logit_softcap": 2.0}]),
])  # fmt: skip
def test_forward_context_dispatch(backend_features, features, forward_gets):
    calls, out, want = dispatch(backend_features, features)
    assert calls == forward_gets
    torch.testing.assert_close(out, want)


def test_reference_backend_takes_both_features():
    assert ReferenceAttentionBackend.features == {"sliding_window", "logit_softcap", "sinks"}
    assert AttentionBackend.features == frozenset() and AttentionBackend.unsupported_features == frozenset()


# ---- the conformance kit's feature settings -----------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("feature", FEATURE_SETS)
def test_kit_feature_settings_change_the_result(block_size, feature):
    """Every setting the kit tries moves the reference beyond the loosest tolerance (so a backend
    ignoring it fails), except a window longer than every sequence, which must change nothing."""
    tol = TOLERANCES[torch.bfloat16]
    for features in feature_settings(feature, block_size, H):
        for requests in feature_batches(block_size).values():
            md, pool, seqs, (q, k, v), reqs = paged_batch(torch.Generator().manual_seed(3), requests, block_size)
            cache = canonical_cache(md, pool, seqs, reqs, block_size)
            write_kv(cache, k, v, md.slot_mapping)
            args = (q, cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, SCALE)  # scores ~N(0, 1)
            moved = (paged_attention(*args, **features) - paged_attention(*args)).abs().max()  # type: ignore[arg-type]
            if features.get("sliding_window", 0) >= max(md.seq_lens_cpu) and features.keys() == {"sliding_window"}:
                assert moved == 0, features
            else:
                assert moved > tol["atol"] + tol["rtol"], (features, requests)


# ---- encoder attention (non-causal, packed sequences) -------------------------------------------


def cu_seqlens(lengths):
    return torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)


def block_diagonal_sdpa(q, k, v, lengths, scale):
    """Every packed token at once, by torch SDPA in float64 with a block-diagonal mask: token i
    sees token j iff both lie in the same sequence."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    allowed = seq.unsqueeze(1) == seq.unsqueeze(0)  # [T, T]
    out = F.scaled_dot_product_attention(*(t.double().transpose(0, 1) for t in (q, k, v)), attn_mask=allowed,
                                         scale=scale)  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    "lengths", [(7, 100, 1, 64, 16), (50,), (16, 16, 16, 16, 9), (1, 1, 1)], ids=["mixed", "one", "windows", "ones"]
)
def test_encoder_attention_matches_block_diagonal_sdpa(lengths):
    gen = torch.Generator().manual_seed(sum(lengths))
    q, k, v = (torch.randn(sum(lengths), 4, 32, generator=gen) for _ in range(3))
    out = encoder_attention(q, k, v, cu_seqlens(lengths), max(lengths), 0.2)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), block_diagonal_sdpa(q, k, v, lengths, 0.2), atol=1e-5, rtol=1e-5)


def test_encoder_attention_is_bidirectional_and_per_sequence():
    """Unlike causal attention, the first token sees the last; a sequence's output does not
    depend on its neighbours (packing order or content)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    out = encoder_attention(q, k, v, cu_seqlens((5, 7)), 7, 0.5)
    alone = encoder_attention(q[5:], k[5:], v[5:], cu_seqlens((7,)), 7, 0.5)
    torch.testing.assert_close(out[5:], alone)
    swapped = encoder_attention(torch.cat([q[5:], q[:5]]), torch.cat([k[5:], k[:5]]), torch.cat([v[5:], v[:5]]),
                                cu_seqlens((7, 5)), 7, 0.5)  # fmt: skip
    torch.testing.assert_close(swapped[:7], out[5:])
    torch.testing.assert_close(swapped[7:], out[:5])
    v2 = v.clone()
    v2[11] += 1.0  # the last key of the second sequence
    moved = encoder_attention(q, k, v2, cu_seqlens((5, 7)), 7, 0.5)
    assert (moved[5] - out[5]).abs().max() > 1e-3  # its first token sees it
    torch.testing.assert_close(moved[:5], out[:5], atol=0, rtol=0)  # the other sequence does not


def test_encoder_attention_edge_cases():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(4, 3, 8, generator=gen) for _ in range(3))
    # a 1-token sequence attends only to itself: its output is its value
    out = encoder_attention(q, k, v, cu_seqlens((1, 3)), 3, 0.3)
    torch.testing.assert_close(out[0], v[0])
    # empty sequences (equal consecutive offsets) contribute nothing
    torch.testing.assert_close(encoder_attention(q, k, v, cu_seqlens((0, 1, 0, 3, 0)), 3, 0.3), out)
    # an empty batch
    e = torch.empty(0, 3, 8)
    assert encoder_attention(e, e, e, cu_seqlens(()), 0, 0.3).shape == (0, 3, 8)
    # half precision in, fp32 math, the query's dtype out
    half = encoder_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_seqlens((4,)), 4, 0.3)
    assert half.dtype == torch.bfloat16
    want = encoder_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), cu_seqlens((4,)), 4, 0.3)
    torch.testing.assert_close(half, want.bfloat16(), atol=0, rtol=0)


def test_encoder_attention_default_is_the_reference():
    """A backend that does not override `encoder_attention` runs core's reference."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(3))
    cu = cu_seqlens((2, 7))
    out = ReferenceAttentionBackend().encoder_attention(q, k, v, cu, 7, 0.4)
    torch.testing.assert_close(out, encoder_attention(q, k, v, cu, 7, 0.4), atol=0, rtol=0)
