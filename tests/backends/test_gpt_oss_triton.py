"""gpt-oss end to end through the Triton kernels, on CPU tensors in the interpreter: the paged
attention kernel with sinks (alone and with a window of 8 on alternate layers) and the fused-MoE
kernel with expert biases and the clamped SwiGLU. Greedy tokens equal transformers' for prompts
longer than the window, batched, with chunked prefill (the `triton-interp` plugin, installed
as `test_triton_e2e.py` installs it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portside.testing.tiny import hf_greedy
from portside.testing.tiny_gpt_oss import make_tiny_gpt_oss

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,  # the triton leg runs it (-m "triton or xgrammar"); a minute or more under the interpreter
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton on CPU tensors: interpreter only"),
]


def test_gpt_oss_through_triton_kernels(triton_plugin, tmp_path: Path) -> None:
    from portside import LLM, SamplingParams

    path = make_tiny_gpt_oss(tmp_path / "m", head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, swiglu_limit=3.0)  # fmt: skip
    llm = LLM(model=str(path), device="triton-interp", max_model_len=64, block_size=16,
              max_num_batched_tokens=16)  # fmt: skip
    runner = llm.engine.executor.runner
    assert runner.attn_backend.name == "triton" and "sinks" in runner.attn_backend.features
    assert type(runner.model.model.layers[0].mlp.ops).__name__ == "TritonModelOps"
    prompts = [[5, 17, 250], [9, 31, 77, 120, 64, 300, 2, 45, 12, 13, 14, 200, 201, 6, 7, 333, 42, 99, 8, 1, 390]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6), f"prompt of {len(prompt)} tokens"
