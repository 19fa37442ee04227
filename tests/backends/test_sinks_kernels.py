"""Attention sinks (gpt-oss: a per-head logit in each query's softmax denominator) in the cpu and
Triton attention paths against core's reference, alone and with a sliding window: decodes (the
native backend's C kernels, a 140-token one in two merged splits), prefill chunks over cached
prefixes (SDPA with its log-sum-exp), mixed batches, GQA 1 and 4, fp32 and bf16, Triton's
split-KV reduce."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import make_case  # tests/backends is on sys.path (rootdir-relative)
from tolerances import assert_close

from portside.attention import reference
from portside.backends.cpu import kernels
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.contract import AttentionBackend

SCALE = 0.25
BATCHES = {  # (q_lens, seq_lens), decodes first
    "decodes": ([1] * 5, [1, 7, 9, 24, 140]),
    "prefills": ([16, 9, 3], [16, 40, 3]),
    "mixed": ([1, 1, 7, 12], [5, 33, 50, 12]),
}
WINDOWS = [None, 1, 13, 200]


def _sinks(num_heads: int) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, num_heads)  # scores here are ~N(0, 1): some heads mostly sink


def _native() -> AttentionBackend:
    reason = kernels.native_unavailable_reason()
    if reason:
        pytest.skip(f"native cpu kernels unavailable: {reason}")
    return NativeAttentionBackend()


CPU_BACKENDS = {"torch": CpuAttentionBackend, "native": _native}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"window{w}" for w in WINDOWS])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", list(CPU_BACKENDS))
def test_cpu_sinks_match_the_reference(name, batch, window, gqa, dtype):
    backend = CPU_BACKENDS[name]()
    assert "sinks" in backend.features
    heads, kv_heads = gqa
    q_lens, seq_lens = BATCHES[batch]
    case = make_case(backend, q_lens, seq_lens, heads, kv_heads, 64, 8, dtype=dtype, seed=5)
    md = case.metadata
    features = {"sinks": _sinks(heads), **({"sliding_window": window} if window else {})}
    reference.write_kv(case.ref_cache, case.key, case.value, md.slot_mapping)
    args = (case.query, case.ref_cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, SCALE * 4)
    expected = reference.paged_attention(*args, **features)
    assert (expected - reference.paged_attention(*args, sliding_window=window)).abs().max() > 0.05  # not vacuous
    out = backend.forward(case.query, case.key, case.value, case.cache, backend.prepare(md), SCALE * 4, **features)
    assert_close(out, expected, dtype, f"{name} {batch} {features}")


def test_reference_sinks_are_transformers_eager_attention():
    """`attend` with sinks equals transformers' gpt-oss eager attention (its sink column)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 16, generator=gen) for h in (8, 2, 2))
    sinks = torch.randn(8, generator=gen)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    module = SimpleNamespace(num_key_value_groups=4, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q, k, v, causal, scaling=0.25)  # [1, 11, 8, 16]
    got = reference.attend(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), 0.25, sinks=sinks)
    torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=1e-5)


# ---- Triton, under the interpreter without a GPU ------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5, 17])
@pytest.mark.parametrize("batch", ["decodes", "mixed"])
def test_triton_sinks_match_the_reference(batch, window, splits, kernel_device):
    pytest.importorskip("triton")
    from test_triton_attention import expected_output, make_batch, run_backend

    from portside.backends.triton.attention import TritonAttentionBackend

    backend = TritonAttentionBackend(num_splits=splits)
    assert "sinks" in backend.features
    q_lens, seq_lens = BATCHES[batch]
    data = make_batch(q_lens, seq_lens, 8, 2, 64, 16, torch.float32, kernel_device, seed=7)
    features = {"sinks": _sinks(8), **({"sliding_window": window} if window else {})}
    expected = expected_output(data, SCALE, **features)
    out = run_backend(data, backend, SCALE, **{**features, "sinks": features["sinks"].to(kernel_device)})
    assert_close(out, expected)
