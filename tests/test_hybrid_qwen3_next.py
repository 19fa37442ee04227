"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet beside gated attention) against
transformers, on tiny random-weight models of several shapes: key/value heads 2/4, 2/2, 1/2
(value heads per key head 2 and 1), key and value head dims that differ, convolution kernels 2-4,
attention layers first, last or alternating, dense MLPs, experts with a shared expert,
partial rotary 1/4 and 1/2.

- prompt logits through a hand-built `ForwardContext` (reference attention, zeroed state slots),
  whole and in chunks that continue from the state, fp32 (and bf16: no further from transformers'
  fp32 than transformers' own bf16 is), and over two tensor-parallel ranks (threads);
- greedy token ids through `portside.LLM`, batched (prompts of 1-30 tokens) and alone, with
  chunked prefill, preemption and a prefix-cache hit in one run;
- refusals: heads that do not split over the ranks; checkpoint tensors missing or extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.config import ModelConfig
from portside.contract import Communicator, SingleRankCommunicator
from portside.model.registry import load_model
from portside.testing.hybrid_steps import HandSteps
from portside.testing.tiny import hf_greedy, hf_logits
from portside.testing.tiny_hybrid import make_tiny_hybrid

_BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             intermediate_size=96)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

# name -> (config class, architecture, config kwargs)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # attention in the last of 4 layers (the default interval); 2 key / 4 value heads; layer 1 dense
    "next-moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _BASE, **_MOE, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, mlp_only_layers=[1])),
    # attention first, then two linear layers; one value head per key head; kernel 2; MQA; half rotary
    "next-dense": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _BASE, seed=1, num_experts=0, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        layer_types=["full_attention", "linear_attention", "linear_attention"], num_hidden_layers=3,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # alternating layers; 1 key / 2 value heads; dk 16, dv 8; kernel 3; MHA
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _BASE, seed=2, num_key_value_heads=4, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=3)),
    # experts in every layer, top-2 of 8 renormalised, a shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        _BASE, **dict(_MOE, num_experts=8), seed=3, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
}

# Model-level fp32 logit tolerance: transformers computes a prompt's delta rule in chunks (a
# triangular solve per 64 tokens), portside's reference token by token; the two orders differ by
# ~1e-4 on these widened models' logits of magnitude ~15.
LOGIT_TOLERANCE = {"atol": 5e-4, "rtol": 1e-4}
# bf16: the mean error against transformers' fp32 logits, at most this much above transformers' bf16 own
BF16_ERROR_RATIO = 1.25

PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def _make(name: str, folder: Path) -> Path:
    config_class, arch, kwargs = CASES[name]
    return make_tiny_hybrid(folder, config_class, arch, **kwargs)


def _load(path: Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    return load_model(ModelConfig(path=str(path), max_model_len=256, dtype=dtype), torch.device("cpu"), **kwargs)


def test_prompt_logits_whole_and_in_chunks(case: Path) -> None:
    model = _load(case)
    expected = hf_logits(case, PROMPT)
    torch.testing.assert_close(HandSteps(model).step([(0, PROMPT)]), expected, **LOGIT_TOLERANCE)
    seq = HandSteps(model)
    got = [seq.step([(0, PROMPT[:5])]), seq.step([(0, PROMPT[5:6])]), seq.step([(0, PROMPT[6:15])]),
           seq.step([(0, PROMPT[15:])])]
    torch.testing.assert_close(torch.cat(got), expected, **LOGIT_TOLERANCE)


def test_two_sequences_in_one_step(case: Path) -> None:
    """A decode of one sequence and a prefill chunk of another in the same step, each in its slot."""
    model = _load(case)
    other = PROMPT[::-1][:9]
    seq = HandSteps(model)
    seq.step([(0, PROMPT[:10])])
    rows = seq.step([(0, PROMPT[10:11]), (1, other)])
    torch.testing.assert_close(rows[0], hf_logits(case, PROMPT[:11])[-1], **LOGIT_TOLERANCE)
    torch.testing.assert_close(rows[1:], hf_logits(case, other), **LOGIT_TOLERANCE)


def test_bf16_no_further_from_fp32_than_transformers_bf16(case: Path) -> None:
    """bf16 rounding through recurrent layers moves these widened models' logits by ~0.1-0.3 (and
    flips near-tied experts), in transformers as in portside: compare both with the fp32 oracle."""
    from transformers import AutoModelForCausalLM

    reference = hf_logits(case, PROMPT)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(str(case), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = (hf_bf16(torch.tensor([PROMPT])).logits[0].float() - reference).abs().mean()
    ours = (HandSteps(_load(case, torch.bfloat16)).step([(0, PROMPT)]) - reference).abs().mean()
    assert ours <= BF16_ERROR_RATIO * theirs, (float(ours), float(theirs))


@pytest.mark.parametrize("name", ["next-moe", "next-dense", "qwen3_5_moe"])
def test_tensor_parallel_logits(name: str, tmp_path: Path) -> None:
    """Two ranks (threads with real collectives): key and value heads, conv channels, state and
    experts split; next-dense's one KV head replicated."""
    from test_models import run_ranks

    path = _make(name, tmp_path / name)
    expected = hf_logits(path, PROMPT)

    def rank(comm: Communicator, r: int) -> Any:
        model = _load(path, comm=comm, tp_rank=r, tp_size=2)
        seq = HandSteps(model)
        return (model, torch.cat([seq.step([(0, PROMPT[:7])]), seq.step([(0, PROMPT[7:])])]))

    results = run_ranks(2, rank)
    whole = _load(path).state_spec()
    for r in range(2):
        model, logits = results[r]
        torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE)
        half = model.state_spec()
        assert half.shapes[0][0] * 2 == whole.shapes[0][0] and half.shapes[1][0] * 2 == whole.shapes[1][0]


def test_heads_that_do_not_split_are_refused(tmp_path: Path) -> None:
    path = _make("qwen3_5", tmp_path / "m")  # 1 key head, 2 value heads
    with pytest.raises(ValueError, match=r"1 key heads and 2 value heads cannot be split evenly over 2"):
        _load(path, comm=SingleRankCommunicator(), tp_rank=0, tp_size=2)


def test_checkpoint_tensors_missing_or_extra(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = _make("next-moe", tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    model = _load(path)
    # multi-token-prediction heads (real Qwen3-Next checkpoints carry them) are not used
    model.check_loaded(model.load_weights([*tensors.items(), ("mtp.fc.weight", torch.zeros(2, 2))]))
    kept = [(n, t) for n, t in tensors.items() if n != "model.layers.0.linear_attn.A_log"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn\.A_log"):
        model.check_loaded(model.load_weights(kept))
    with pytest.raises(ValueError, match="in_proj_qkv.*has no place"):
        model.load_weights([("model.layers.0.linear_attn.in_proj_qkv.weight", torch.zeros(48, 64))])
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        model.load_weights([("model.layers.0.linear_attn.in_proj_qkvz.weight", torch.zeros(10, 64))])


# ---- the engine ----------------------------------------------------------------------------

def _engine_cases(fast: str) -> list[Any]:
    """Every case; one runs in the quick suite (an engine run and transformers' generate take 5-10 s)."""
    return [c if c == fast else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]


def _assert_parity(path: Path, prompts: list[list[int]], outs: list[Any]) -> None:
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def _assert_all_free(llm: LLM) -> None:
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("case", _engine_cases("next-moe"), indirect=True)
def test_greedy_batched_and_alone(case: Path) -> None:
    llm = LLM(model=str(case), device="cpu", max_model_len=128, block_size=4)
    prompts = _prompts(0, [1, 4, 9, 17, 30])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _assert_parity(case, prompts, outs)
    alone = llm.generate([{"prompt_token_ids": prompts[-2]}], GREEDY, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[-2].outputs[0].token_ids
    _assert_all_free(llm)


@pytest.mark.parametrize("case", _engine_cases("qwen3_5"), indirect=True)
def test_greedy_chunked_prefill_preemption_and_prefix_hit(case: Path) -> None:
    """A 10-token budget splits prompts (up to 27 tokens) over steps beside decodes; 16 blocks of
    4 tokens cannot hold 5 sequences of ~35 tokens, so some are preempted and recomputed; then a
    prompt sharing the previous one's 20-token prefix hits the cache and restores the state saved
    there."""
    llm = LLM(model=str(case), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=10,
              num_kv_blocks=16)
    prompts = _prompts(1, [23, 11, 19, 27, 14])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    _assert_parity(case, prompts, outs)
    shared = [prompts[3][:20] + [7, 8, 9], prompts[3][:20] + [300, 301]]
    first = llm.generate([{"prompt_token_ids": shared[0]}], GREEDY, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": shared[1]}], GREEDY, use_tqdm=False)
    assert hit[0].num_cached_tokens == 20, hit[0].num_cached_tokens  # the state saved at token 20 restored
    _assert_parity(case, shared, first + hit)
    _assert_all_free(llm)


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_engine(tmp_path: Path) -> None:
    path = _make("next-moe", tmp_path / "m")
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, tensor_parallel_size=2,
              max_num_batched_tokens=16)
    prompts = _prompts(2, [5, 13, 26])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        _assert_parity(path, prompts, outs)
    finally:
        llm.engine.shutdown()
