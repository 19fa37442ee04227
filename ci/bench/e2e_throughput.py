"""On a GPU: end-to-end generation throughput, portside vs transformers' batched `generate`.

A random-weight Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9/3 heads, head_dim 64; the
tiny test tokenizer's vocabulary), bf16, N prompts x OUT new tokens each, greedy, EOS ignored.
Prints one JSON line. Random weights: speed only, no quality.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from portside import LLM, SamplingParams
from portside.testing.tiny import make_tiny_model

SMOLLM_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, max_position_embeddings=2048)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=128)
    a = ap.parse_args()
    path = make_tiny_model(tempfile.mkdtemp(), "llama", **SMOLLM_SHAPE)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 300, (a.num_prompts, a.prompt_len), generator=g).tolist()
    new_tokens = a.num_prompts * a.out_len

    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", max_model_len=a.prompt_len + a.out_len + 16,
              max_num_seqs=a.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=a.out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    ps = time.perf_counter() - t
    del llm
    torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(max_new_tokens=a.out_len, min_new_tokens=a.out_len, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids[:2], **{**kw, "attention_mask": torch.ones_like(ids[:2])})  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    hf = time.perf_counter() - t
    print(json.dumps({"num_prompts": a.num_prompts, "prompt_len": a.prompt_len, "out_len": a.out_len,
                      "portside_tok_s": round(new_tokens / ps, 1), "transformers_tok_s": round(new_tokens / hf, 1),
                      "speedup": round(hf / ps, 2), "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
