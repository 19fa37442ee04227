"""fp8 KV caches on the tpu platform (torch-xla's PJRT CPU device in the xla leg; skipped
without torch-xla): the engine with `--kv-cache-dtype fp8_e4m3 / fp8_e5m2` runs its bucketed
graphs without recompiling after warm-up (strict mode) and gives exactly the greedy tokens of
core's reference attention over an fp8 cache of the same format. The kernels themselves are the
conformance kit's (`test_xla_conformance.py`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
pytestmark = [pytest.mark.xla, pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not importable (the xla leg installs it)")]

if HAS_XLA:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla starts its runtime

BUCKETS = {"xla_token_buckets": "16,64", "xla_request_buckets": "1,4", "xla_width_buckets": "4,8", "xla_strict": "1"}
PROMPTS = ([5, 17, 33, 9, 60, 12, 7], list(range(20, 60)))


@pytest.fixture(scope="module")
def clear_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of tests/test_kv_cache_dtype.py (init_std 0.1: clear logit margins)."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("clear_llama"), "llama", init_std=0.1)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_through_the_bucketed_graphs(clear_llama, kv):
    from portside import LLM, SamplingParams
    from portside.attention.reference import ReferenceAttentionBackend
    from portside.backends.xla.platform import XlaPlatform
    from portside.config import ModelConfig
    from portside.contract import kv_cache_torch_dtype
    from portside.model.registry import load_model
    from portside.testing.paged import PagedSequence

    if not XlaPlatform.is_available():
        pytest.skip(f"tpu platform unavailable: {XlaPlatform.is_available().reason}")
    llm = LLM(model=str(clear_llama), device="tpu", max_model_len=128, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=64, num_kv_blocks=40 + len(kv), enable_prefix_caching=False,
              kv_cache_dtype=kv, platform_options=BUCKETS)  # fmt: skip
    runner = llm.engine.executor.runner
    cdt = kv_cache_torch_dtype(kv, torch.float32)
    assert runner.attn_backend.name == "xla-gather" and all(c.dtype == cdt for c in runner.kv_caches)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert runner.graph_runner.stats.recompiles == 0
    model = load_model(ModelConfig(path=str(clear_llama)), torch.device("cpu"))
    backend = ReferenceAttentionBackend()
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == PagedSequence(model, backend, 16, 128, cache_dtype=cdt).greedy(prompt, 8)
