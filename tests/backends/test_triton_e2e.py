"""End-to-end greedy parity through the Triton attention backend, on CPU tensors in the interpreter.

The device is `triton-interp` (plugins/triton_interp: CPU tensors, `TritonAttentionBackend`),
pip-installed into a private folder by the `triton_interp_site` fixture and put on sys.path, so
it registers the way a third-party plugin does: a distribution's entry point in the
``portside.platforms`` group. The engine then selects it with ``device="triton-interp"``; its
greedy tokens must equal transformers' on a tiny random-weight model (head_dim 64, GQA 2), alone
and batched, with chunked prefill across block boundaries. Quantized at load (``int8``, ``fp8``),
the Triton quantized-linear kernels give the greedy tokens of the same engine on core's reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portside.testing.tiny import hf_greedy, make_tiny_model

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,  # the triton leg runs it (-m "triton or xgrammar"); minutes under the interpreter
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton on CPU tensors: interpreter only"),
]

MAX_TOKENS = 10
WORDS = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun".split()


@pytest.fixture(scope="module")
def tiny_gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_hd64"), "llama", head_dim=64)


def test_greedy_parity_through_triton_backend(triton_plugin, tiny_gqa_model: Path) -> None:
    from portside import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_gqa_model),
        device="triton-interp",
        max_model_len=128,
        block_size=16,
        max_num_batched_tokens=24,  # a 37-token prompt is prefilled in chunks
    )
    from portside_triton_interp.platform import TritonInterpPlatform

    runner = llm.engine.executor.runner
    assert llm.engine.platform is TritonInterpPlatform and runner.attn_backend.name == "triton"
    base = llm.get_tokenizer().encode(" ".join(WORDS * 4))
    prompts = [base[:5], base[3:20], base[1:38]]  # ends within a block, at one, past two
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(tiny_gqa_model, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_moe"])
def test_window_softcap_and_experts_through_triton_kernels(triton_plugin, arch: str, tmp_path: Path) -> None:
    """Gemma 2 (window 8 on alternate layers, attention and final soft-caps) and Qwen3-MoE (the
    Triton fused-MoE kernel): greedy parity with transformers on prompts longer than the window."""
    from portside import LLM, SamplingParams

    path = make_tiny_model(tmp_path / arch, arch)
    llm = LLM(model=str(path), device="triton-interp", max_model_len=64, block_size=16)
    runner = llm.engine.executor.runner
    assert runner.attn_backend.name == "triton"
    if arch == "qwen3_moe":
        assert type(runner.model.model.layers[0].mlp.ops).__name__ == "TritonModelOps"
    base = llm.get_tokenizer().encode(" ".join(WORDS * 4))
    prompts = [base[:3], base[2:21]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6), f"prompt of {len(prompt)} tokens"


@pytest.mark.slow  # two engines under the interpreter: about 35 s each on a loaded 2-core host
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantized_model_through_triton_kernels(triton_plugin, tiny_gqa_model: Path, method: str, monkeypatch) -> None:
    """``--quantization int8`` (weight-only) and ``fp8`` (FP8 activations too) through the Triton
    quantized kernels: greedy tokens equal those of the same engine on core's reference ops."""
    from portside import LLM, SamplingParams
    from portside.backends.triton.quant import TritonQuantLayout, TritonQuantOps
    from portside.contract import ModelOps

    base = [1, 5, 9, 33, 70, 12, 40, 41, 2, 17, 18, 19, 60, 61, 62, 63, 64, 8]
    prompts = [base[:4], base]  # within a block, across one
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def greedy() -> tuple[list[list[int]], object]:
        llm = LLM(model=str(tiny_gqa_model), device="triton-interp", max_model_len=64, block_size=16, quantization=method)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        layer = llm.engine.executor.runner.model.model.layers[0]
        return [o.outputs[0].token_ids for o in outs], layer.self_attn.qkv_proj.quant.layout

    tokens, layout = greedy()
    assert isinstance(layout, TritonQuantLayout) and layout.path == ("dequant" if method == "int8" else "scaled_mm")
    for name in ("prepare_quantized", "quantized_linear"):
        monkeypatch.setattr(TritonQuantOps, name, getattr(ModelOps, name))
    reference, layout = greedy()
    assert layout is None
    assert tokens == reference


@pytest.mark.slow  # one engine under the interpreter
def test_gptq_act_order_through_triton_kernels(triton_plugin, tiny_gqa_model: Path, tmp_path: Path) -> None:
    """A GPTQ desc_act checkpoint whose fused projections have different column orders: each part
    of q/k/v and gate/up goes through the Triton dequant GEMM with its own g_idx, and the greedy
    tokens equal transformers' on the dequantized weights."""
    from portside import LLM, SamplingParams
    from portside.backends.triton.quant import TritonQuantLayout
    from portside.testing.quant_checkpoints import write_quantized

    q, oracle = write_quantized(tiny_gqa_model, tmp_path / "gptq", "gptq", bits=4, group_size=32, desc_act=True)
    llm = LLM(model=str(q), device="triton-interp", max_model_len=64, block_size=16)
    layer = llm.engine.executor.runner.model.model.layers[0]
    for fused, parts in ((layer.self_attn.qkv_proj, 3), (layer.mlp.gate_up_proj, 2)):
        assert len(fused.quant) == parts
        for w in fused.quant:
            assert w.g_idx is not None and isinstance(w.layout, TritonQuantLayout) and w.layout.path == "dequant"
    prompts = [[1, 5, 9, 33, 70], list(range(3, 21))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 6), f"prompt of {len(prompt)} tokens"


def test_lora_through_triton_kernels(triton_plugin, tiny_gqa_model: Path, tmp_path: Path) -> None:
    """Multi-LoRA (two adapters in one batch, one prompt prefilled in chunks) through the Triton
    shrink / expand kernels: greedy tokens equal transformers + peft with each adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from portside import LLM, LoRARequest, SamplingParams
    from portside.testing.tiny import make_tiny_lora

    loras = [LoRARequest(f"a{i}", i + 1, str(make_tiny_lora(tiny_gqa_model, tmp_path / f"a{i}", r=r, seed=i)))
             for i, r in enumerate((8, 4))]
    llm = LLM(model=str(tiny_gqa_model), device="triton-interp", max_model_len=64, block_size=16,
              max_num_batched_tokens=24, enable_lora=True, max_loras=2, max_lora_rank=8)
    base = llm.get_tokenizer().encode(" ".join(WORDS * 4))
    prompts, which = [base[:5], base[1:30]], [loras[0], loras[1]]  # (the base model's tokens: the test above)
    n = 4  # the interpreter runs each LoRA kernel of each layer in Python: few steps
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=which)
    for prompt, lora, out in zip(prompts, which, outputs):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_gqa_model), lora.lora_path).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        assert out.outputs[0].token_ids == gen[0, len(prompt):].tolist(), f"{lora.lora_name}, prompt of {len(prompt)} tokens"


def test_speculative_decoding_on_a_hybrid_through_triton_kernels(triton_plugin, tmp_path: Path) -> None:
    """Qwen3-Next (Gated DeltaNet) with prompt lookup: prefills and decodes on the Triton recurrent
    kernels, verify steps (which keep each token's state) on core's reference (`kernels_for`);
    greedy tokens equal transformers', with proposals accepted and rejected."""
    from test_spec_decode_hybrid import NGRAM, QWEN3_NEXT, _echo_prompts

    from portside import LLM, SamplingParams
    from portside.testing.tiny_hybrid import make_tiny_hybrid

    path = make_tiny_hybrid(tmp_path / "qnext", "Qwen3NextConfig", "Qwen3NextForCausalLM", init_std=0.05, **QWEN3_NEXT)
    prompts = _echo_prompts(path, 0)[:2]
    llm = LLM(model=str(path), device="triton-interp", max_model_len=128, block_size=16,
              speculative_config=dict(NGRAM, num_speculative_tokens=3))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    s = llm.engine.stats().spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
