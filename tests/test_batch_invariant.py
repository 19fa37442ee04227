"""Batch-invariant mode (--batch-invariant, issue 50): core's invariant kernels give a row the
same bits whatever its neighbours (and stay close to the plain kernels), and end to end 16
seeded prompts run alone give bitwise the token ids and logprobs they give beside 48 others,
with chunked prefill, prefix-cache hits and a forced preemption; a platform that does not
declare the mode refuses it, naming itself."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portside import LLM, SamplingParams
from portside.engine.args import EngineArgs
from portside.ops import batch_invariant as bi
from portside.ops.attention import attend
from portside.testing.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]

# ---- kernels -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(96, 200), (200, 96), (64, 517)])
def test_linear_rows_do_not_depend_on_the_batch(dtype, k, n):
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    alone = torch.cat([bi.linear(x[i : i + 1], w, b) for i in range(70)])
    for rows in (2, 3, 5, 9, 16, 17, 33, 70):
        assert torch.equal(bi.linear(x[:rows], w, b), alone[:rows]), rows
    shifted = bi.linear(torch.cat([torch.randn(5, k, generator=gen).to(dtype), x]), w, b)[5:]
    assert torch.equal(shifted, alone)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.float(), F.linear(x.float(), w.float(), b.float()), rtol=tol, atol=tol * k ** 0.5)


def test_fixed_sum_norm_and_activations_match_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 100, generator=gen) * 3
    torch.testing.assert_close(bi.fixed_sum(x), x.sum(-1), rtol=1e-5, atol=1e-5)
    assert bi.fixed_sum(x[:, :0]).shape == (37,)
    w = torch.rand(100, generator=gen) + 0.5
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(bi.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.rms_norm(x, w, 1e-6, offset=True), ref / w * (1 + w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.silu(x), F.silu(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bi.gelu(x), F.gelu(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bi.gelu_tanh(x), F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="relu"):
        bi.activation("relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_do_not_depend_on_the_tensor_size(dtype):
    """torch's SiLU/GELU compute a tensor's tail (after its last full vector) with scalar code that
    differs in the last bit; the invariant ones give each element the same bits at any size."""
    x = (torch.randn(100_003, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    for fn in (bi.silu, bi.gelu, bi.gelu_tanh):
        whole = fn(x)
        pieces = torch.cat([fn(x[i : i + 7]) for i in range(0, 3500, 7)])
        assert torch.equal(pieces, whole[:3500]), fn.__name__


def _paged_inputs(seq_lens, q_lens, kvh=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    span = max(seq_lens)
    keys = torch.randn(len(seq_lens), span, kvh, d, generator=gen)
    values = torch.randn(len(seq_lens), span, kvh, d, generator=gen)
    for r, n in enumerate(seq_lens):
        keys[r, n:], values[r, n:] = 0, 0
    req = torch.tensor([r for r, q in enumerate(q_lens) for _ in range(q)])
    pos = torch.tensor([p for n, q in zip(seq_lens, q_lens) for p in range(n - q, n)])
    return keys, values, req, pos


@pytest.mark.parametrize("features", [{}, {"sliding_window": 5}, {"logit_softcap": 3.0}])
def test_paged_attention_matches_the_reference(features):
    seq_lens, q_lens = [1, 9, 17, 30], [1, 9, 4, 13]
    keys, values, req, pos = _paged_inputs(seq_lens, q_lens)
    q = torch.randn(len(req), 6, 16, generator=torch.Generator().manual_seed(7))
    out = bi.paged_attention(q, keys, values, req, pos, 4, 0.25, **features)
    start = 0
    for r, (n, m) in enumerate(zip(seq_lens, q_lens)):
        ref = attend(q[start : start + m], keys[r, :n], values[r, :n], 0.25, **features)
        torch.testing.assert_close(out[start : start + m], ref, rtol=1e-5, atol=1e-5)
        start += m


@pytest.mark.parametrize("d,block", [(16, 8), (64, 4), (64, 16)])
def test_paged_attention_is_chunk_and_batch_invariant(d, block):
    """A 30-token sequence's queries in one call, in chunks of 7 beside other requests, or each
    alone with only the keys up to it (a lone query over one block: the products' operands are
    views there, copies in a batch): the same bits. head_dim 64 takes MKL's batched GEMM, 16
    torch's own small-matrix loop."""
    keys, values, req, pos = _paged_inputs([30, 23], [30, 23], d=d)
    q = torch.randn(53, 4, d, generator=torch.Generator().manual_seed(3))
    whole = bi.paged_attention(q[:30], keys[:1], values[:1], req[:30], pos[:30], block, 0.25)
    mixed = bi.paged_attention(q, keys, values, req, pos, block, 0.25)
    assert torch.equal(mixed[:30], whole)
    for a in range(0, 30, 7):
        idx = torch.cat([torch.arange(a, min(a + 7, 30)), torch.arange(30, 40)])
        part = bi.paged_attention(q[idx], keys, values, req[idx], pos[idx], block, 0.25)
        assert torch.equal(part[: min(7, 30 - a)], whole[a : a + 7])
    for p in range(30):
        lone = bi.paged_attention(q[p : p + 1], keys[:1, : p + 1], values[:1, : p + 1], req[:1], pos[p : p + 1], block, 0.25)
        assert torch.equal(lone[0], whole[p]), p


# ---- end to end ----------------------------------------------------------------------------------

WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
         "and the river runs to the sea under a bright sky full of birds").split()
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory) -> Path:
    """Shapes that are neither powers of two nor multiples of a vector: hidden 96, MLP 200,
    6 query heads over 2 KV heads (GQA 3), head_dim 48 (attention's products then take MKL's
    batched GEMM, as real models' do), 3 layers."""
    return make_tiny_model(tmp_path_factory.mktemp("bi_llama"), "llama", hidden_size=96, intermediate_size=200,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=48, num_hidden_layers=3)


def _prompts_and_params(tokenizer):
    """64 prompts of 3..60 tokens (some sharing a prefix); the 16 targets (every 4th)
    sample with a seed and ask for logprobs; the rest mix greedy, seeded and unseeded sampling."""
    rnd = random.Random(0)
    base = tokenizer.encode(" ".join(WORDS * 6))
    prompts, params = [], []
    for i in range(64):
        n = 3 if i == 0 else rnd.randint(3, 60)  # (prompt 0: its first decode attends over one whole block)
        start = 0 if i % 3 == 0 else rnd.randint(1, 40)
        prompts.append(base[start : start + n])
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1000 + i, max_tokens=MAX_TOKENS,
                                         logprobs=3, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=rnd.choice([0.0, 0.7, 1.2]), seed=rnd.choice([None, i]),
                                         max_tokens=rnd.randint(4, 14), logprobs=rnd.choice([None, 1]), ignore_eos=True))
    return prompts, params


def _result(out):
    o = out.outputs[0]
    lps = [sorted((tok, lp.logprob, lp.rank) for tok, lp in step.items()) for step in o.logprobs]
    return o.token_ids, lps


def _alone_and_together(model: Path, dtype: str, **engine):
    # one torch thread: on a shared 2-core machine two threads wait on each other at every small
    # matmul (~100x slower here); the mode's guarantee holds for any fixed thread count
    common = dict(device="cpu", dtype=dtype, max_model_len=128, block_size=4, batch_invariant=True,
                  platform_options={"cpu_threads": "1"}, **engine)
    alone_llm = LLM(model=str(model), max_num_batched_tokens=2048, **common)
    prompts, params = _prompts_and_params(alone_llm.get_tokenizer())
    targets = range(0, 64, 4)
    alone = {i: _result(alone_llm.generate([{"prompt_token_ids": prompts[i]}], params[i], use_tqdm=False)[0])
             for i in targets}
    # a 24-token budget splits most prompts into chunks; 40 blocks of 4 tokens cannot hold the
    # batch's sequences, so requests are preempted and recomputed
    together_llm = LLM(model=str(model), max_num_batched_tokens=24, num_kv_blocks=40, **common)
    outs = together_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = together_llm.engine.stats()
    return alone, {i: _result(outs[i]) for i in targets}, stats


def _assert_bitwise(alone, together) -> None:
    for i, (ids, lps) in alone.items():
        assert together[i][0] == ids, f"prompt {i}: token ids {together[i][0]} alone {ids}"
        assert together[i][1] == lps, f"prompt {i}: logprobs differ"
        assert len(ids) == MAX_TOKENS and len(lps) == MAX_TOKENS


def test_alone_equals_together_fp32(odd_llama):
    alone, together, stats = _alone_and_together(odd_llama, "float32")
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    _assert_bitwise(alone, together)


def test_alone_equals_together_bf16(odd_llama):
    from portside.backends.cpu.host import has_native_bf16

    if not has_native_bf16():
        pytest.skip("this CPU has no native bf16 arithmetic (AVX-512-BF16 / AMX): bf16 runs ~100x slower")
    alone, together, stats = _alone_and_together(odd_llama, "bfloat16")
    assert stats.num_preemptions > 0, stats
    _assert_bitwise(alone, together)


@pytest.mark.slow
def test_alone_equals_together_tensor_parallel_2(odd_llama):
    """Two ranks: each sums its half of a row-parallel product, and a + b is exact either way round."""
    alone, together, stats = _alone_and_together(odd_llama, "float32", tensor_parallel_size=2)
    assert stats.num_preemptions > 0, stats
    _assert_bitwise(alone, together)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3"])
def test_other_decoders_alone_equal_together(tmp_path, arch):
    """Gemma 2: sliding window, logit soft-caps, GELU (tanh), Gemma's norms; Gemma 3: sliding and
    full layers, q/k norms; Qwen3: q/k norms."""
    model = make_tiny_model(tmp_path / arch, arch)
    alone, together, stats = _alone_and_together(model, "float32")
    _assert_bitwise(alone, together)


# ---- refusals ------------------------------------------------------------------------------------


def test_platform_without_support_refuses(odd_llama):
    sys.path.insert(0, str(ROOT / "plugins" / "npu_example"))
    try:
        from portside_npu_example.platform import NpuExamplePlatform
    finally:
        sys.path.pop(0)
    from portside.backends.cuda.platform import CudaPlatform

    for platform in (NpuExamplePlatform, CudaPlatform):
        assert not platform.supports_batch_invariant
        with pytest.raises(ValueError, match=f"not supported by the {platform.name} platform"):
            EngineArgs(model=str(odd_llama), batch_invariant=True).create_engine_config(platform)


def test_features_without_invariant_kernels_refuse(odd_llama, tmp_path):
    from portside.backends.cpu.platform import CpuPlatform

    with pytest.raises(ValueError, match="--enable-lora"):
        EngineArgs(model=str(odd_llama), batch_invariant=True, enable_lora=True).create_engine_config(CpuPlatform)
    with pytest.raises(ValueError, match="--speculative-config"):
        EngineArgs(model=str(odd_llama), batch_invariant=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config(CpuPlatform)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1 or 2"):
        EngineArgs(model=str(odd_llama), batch_invariant=True, tensor_parallel_size=3).create_engine_config(CpuPlatform)
    moe = make_tiny_model(tmp_path / "moe", "mixtral")
    with pytest.raises(ValueError, match="does not support MixtralForCausalLM.*has no batch-invariant kernel"):
        LLM(model=str(moe), device="cpu", max_model_len=64, batch_invariant=True)


def test_cli_flag(odd_llama):
    import argparse

    from portside.engine.args_cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--batch-invariant"])
    assert engine_kwargs(args)["batch_invariant"] is True
