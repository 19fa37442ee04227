"""A block-FP8 DeepSeek-V3 checkpoint (every projection in transformers' FineGrainedFP8 format,
as DeepSeek-V3/R1 ship, kv_b_proj included): the quantized layers stay quantized, kv_b_proj is
dequantized once for the absorbed form's W_UK / W_UV, and the greedy tokens and logits equal
transformers' cpu dequantized run of the same folder."""

from __future__ import annotations

import torch

from portside import LLM, SamplingParams
from portside.attention.reference import ReferenceAttentionBackend
from portside.testing.fp8_mxfp4_checkpoints import fp8_oracle
from portside.testing.paged import PagedSequence
from portside.testing.tiny_deepseek import make_tiny_deepseek, write_deepseek_fp8_block

PROMPTS = [[5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13], [7, 8, 9]]


@torch.no_grad()
def test_block_fp8_deepseek_v3_matches_transformers_dequantized(tmp_path):
    src = make_tiny_deepseek(tmp_path / "hf", "v3", q_lora_rank=32, qk_rope_head_dim=16, kv_lora_rank=32)
    path = write_deepseek_fp8_block(src, tmp_path / "fp8", (16, 16))
    oracle = fp8_oracle(path)
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64, dtype="float32")
    model = llm.engine.executor.runner.model
    attn = model._layer(0).self_attn
    assert attn.kv_b_proj.quant is not None and attn.q_a_proj.quant is not None and attn.kv_b_proj.weight is None
    logits = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPTS[0])
    torch.testing.assert_close(logits, oracle(torch.tensor([PROMPTS[0]])).logits[0].float(), atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                               pad_token_id=0, temperature=None, top_p=None, top_k=None)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want
    llm.shutdown()
