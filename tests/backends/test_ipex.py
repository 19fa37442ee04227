"""The cpu backend's IPEX path (intel-extension-for-pytorch PagedAttention), end to end.

Runs in the ipex leg (`ci/legs/ipex.sh`: torch 2.8, IPEX 2.8, transformers < 5), where IPEX
imports; elsewhere every test skips with the reason. The kernel-level checks against the
reference are the "ipex" cases of test_cpu_attention.py.
"""

from __future__ import annotations

import os

import pytest

from portside.backends.cpu.ipex_attention import ipex_unavailable_reason

_REASON = ipex_unavailable_reason()
if _REASON and os.environ.get("PORTSIDE_REQUIRE_IPEX"):
    raise RuntimeError(f"the ipex leg needs IPEX: {_REASON}")
pytestmark = [pytest.mark.ipex, pytest.mark.skipif(_REASON is not None, reason=f"outside the ipex leg: {_REASON}")]

MAX_TOKENS = 10


def _llm(path, **options):
    from portside import LLM

    return LLM(model=str(path), device="cpu", max_model_len=128, block_size=8, max_num_batched_tokens=24,
               platform_options=options)


def test_auto_selects_ipex_and_layout(tiny_llama):
    llm = _llm(tiny_llama)
    runner = llm.engine.executor.runner
    assert runner.attn_backend.name == "ipex-paged"
    spec = runner.kv_cache_spec()
    # IPEX's layout: [2, num_blocks, num_kv_heads, block_size, head_size]
    assert runner.kv_caches[0].shape[2:] == (spec.num_kv_heads, 8, spec.head_size)


def test_option_torch_keeps_the_torch_path(tiny_llama):
    llm = _llm(tiny_llama, cpu_attention="torch")
    assert llm.engine.executor.runner.attn_backend.name == "torch-sdpa"


def test_greedy_parity_with_transformers(tiny_llama):
    from portside import SamplingParams
    from portside.testing.tiny import hf_greedy

    llm = _llm(tiny_llama, cpu_attention="ipex")
    base = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog while a small cat sleeps " * 3)
    prompts = [base[i : i + n] for i, n in enumerate([3, 9, 17, 30])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"
