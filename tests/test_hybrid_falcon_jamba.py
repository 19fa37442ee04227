"""Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer, µP multipliers) and Jamba
(Mamba-1 layers, attention every few layers, experts every few layers) against transformers, on
tiny random-weight models of several shapes: Mamba heads 4/6/8 over 1/2/4 groups, state sizes
4-16, convolution kernels 2-4, the mixer wider than 2 x hidden, its gated norm before or after
the gate or absent, biases on or off; Jamba's attention first, between or last, experts in every
other layer, every layer or none.

- prompt logits through a hand-built `ForwardContext` (reference attention, state slots holding
  garbage until written), whole and in chunks that continue from the state, two sequences in one
  step, bf16 (no further from transformers' fp32 than transformers' own bf16), two
  tensor-parallel ranks (threads);
- greedy token ids through `portside.LLM`, batched and alone, with chunked prefill, preemption
  and a prefix-cache hit in one run;
- refusals: sizes that do not split over the ranks; checkpoint tensors missing or extra.
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

_FALCON = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256)
# every multiplier away from 1, each a different value (one applied in the wrong place shows)
_MUP = dict(embedding_multiplier=0.8, lm_head_multiplier=1.3, key_multiplier=0.7, attention_in_multiplier=1.1,
            attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.8,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], mlp_multipliers=[1.2, 0.9])
_JAMBA = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)

# name -> (config class, architecture, config kwargs)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # 4 Mamba heads of 8 over 2 groups, state 8; the gated norm normalises, then gates
    "falcon-mup": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        _FALCON, **_MUP, num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2,
        mamba_rms_norm=True, mamba_norm_before_gate=True)),
    # mamba_d_ssm 96 (not expand x hidden): 6 heads of 16, one group, state 16, kernel 3; gate, then
    # norm; attention head_dim 16 (not hidden / heads)
    "falcon-wide": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        _FALCON, **_MUP, seed=1, num_hidden_layers=2, head_dim=16, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_state=16,
        mamba_n_groups=1, mamba_d_conv=3, mamba_rms_norm=True, mamba_norm_before_gate=False)),
    # no gated norm (y * silu(z)); in_proj bias but none on out_proj; attention and MLP biases; MQA;
    # 8 heads of 4 over 4 groups, state 4, kernel 2
    "falcon-plain": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        _FALCON, seed=2, num_hidden_layers=3, num_key_value_heads=1, mamba_d_ssm=32, mamba_n_heads=8,
        mamba_d_state=4, mamba_n_groups=4, mamba_d_conv=2, mamba_rms_norm=False, mamba_proj_bias=True,
        projectors_bias=False, attention_bias=True, mlp_bias=True, ssm_multipliers=[0.9, 1.1, 1.3, 0.7, 0.95])),
    # attention in layers 1 and 3, 4 experts top-2 in layers 0 and 2; state 8, dt rank 2, kernel 4
    "jamba-moe": ("JambaConfig", "JambaForCausalLM", dict(
        _JAMBA, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8)),
    # attention first, then two Mamba layers; dense MLPs only; expand 1, state 4, dt rank 6, kernel 2,
    # in/out_proj biases, no conv bias; MQA
    "jamba-dense": ("JambaConfig", "JambaForCausalLM", dict(
        _JAMBA, seed=1, num_hidden_layers=3, num_key_value_heads=1, attn_layer_period=3, attn_layer_offset=0,
        num_experts=1, mamba_expand=1, mamba_d_state=4, mamba_dt_rank=6, mamba_d_conv=2, mamba_proj_bias=True,
        mamba_conv_bias=False)),
    # attention last of 4; 8 experts top-1 in every layer; state 16
    "jamba-8x1": ("JambaConfig", "JambaForCausalLM", dict(
        _JAMBA, seed=2, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3, expert_layer_period=1,
        expert_layer_offset=0, num_experts=8, num_experts_per_tok=1, mamba_d_state=16)),
}

# Model-level fp32 logit tolerance: transformers scans a prompt in chunks (Mamba-2's SSD) or in
# parallel, portside's reference token by token.
LOGIT_TOLERANCE = {"atol": 2e-4, "rtol": 1e-4}
# bf16: each row's mean error against transformers' fp32 logits; the median row at most this much
# above transformers' bf16 own (the median: a near-tied top-1 expert that bf16 flips moves one
# row's logits a lot, in transformers as in portside, in different rows)
BF16_ERROR_RATIO = 1.25

PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

FAST = {"falcon-mup", "jamba-moe"}  # the other shapes' logits under -m slow


def _param(name: str, fast: set[str]) -> Any:
    return name if name in fast else pytest.param(name, marks=pytest.mark.slow)


@pytest.fixture(scope="module", params=[_param(c, FAST) for c in sorted(CASES)])
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
    """A decode of one sequence and a prefill of another in the same step, each in its own slot."""
    model = _load(case)
    other = PROMPT[::-1][:9]
    seq = HandSteps(model)
    seq.step([(0, PROMPT[:10])])
    rows = seq.step([(0, PROMPT[10:11]), (1, other)])
    torch.testing.assert_close(rows[0], hf_logits(case, PROMPT[:11])[-1], **LOGIT_TOLERANCE)
    torch.testing.assert_close(rows[1:], hf_logits(case, other), **LOGIT_TOLERANCE)


def test_bf16_no_further_from_fp32_than_transformers_bf16(case: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = hf_logits(case, PROMPT)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(str(case), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = (hf_bf16(torch.tensor([PROMPT])).logits[0].float() - reference).abs().mean(-1).median()
    ours = (HandSteps(_load(case, torch.bfloat16)).step([(0, PROMPT)]) - reference).abs().mean(-1).median()
    assert ours <= BF16_ERROR_RATIO * theirs, (float(ours), float(theirs))


def test_layout(tmp_path: Path) -> None:
    """Jamba's attention, Mamba and expert layers where its config puts them; the cache specs count
    them; the SSM state in the model's dtype unless --mamba-ssm-cache-dtype says otherwise."""
    from portside.model.moe import SparseMoEBlock

    model = _load(_make("jamba-moe", tmp_path / "j"))
    layers = model.model.layers
    assert [layer.self_attn is not None for layer in layers] == [False, True, False, True]
    assert [isinstance(layer.feed_forward, SparseMoEBlock) for layer in layers] == [True, False, True, False]
    kv, state = model.kv_cache_spec(), model.state_spec()
    assert (kv.num_layers, kv.num_kv_heads, kv.head_size) == (2, 2, 8)
    assert (state.num_layers, state.kind, state.shapes, state.dtypes) == (
        2, "mamba", ((64, 3), (64, 8)), (torch.float32, torch.float32))
    folder = _make("falcon-wide", tmp_path / "f")
    falcon = _load(folder, torch.bfloat16)
    kv, state = falcon.kv_cache_spec(), falcon.state_spec()
    assert (kv.num_layers, kv.head_size, kv.dtype) == (2, 16, torch.bfloat16)
    # conv: x (96) + B and C (1 group of 16); SSM: 6 heads x 16 x state 16, in the model's dtype by default
    assert (state.num_layers, state.kind, state.shapes, state.dtypes) == (
        2, "mamba2", ((128, 2), (6, 16, 16)), (torch.bfloat16, torch.bfloat16))
    for path in (folder, tmp_path / "j"):  # --mamba-ssm-cache-dtype float32
        config = ModelConfig(path=str(path), max_model_len=256, dtype=torch.bfloat16)
        state = load_model(config, torch.device("cpu"), mamba_ssm_cache_dtype="float32").state_spec()
        assert state.dtypes == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("name", ["falcon-mup", _param("jamba-moe", set())])
def test_tensor_parallel_logits(name: str, tmp_path: Path) -> None:
    """Two ranks (threads with real collectives): attention and Mamba heads, groups, conv
    channels, state and experts split."""
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


def test_sizes_that_do_not_split_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Mamba intermediate size \(64\) is not divisible by the tensor-parallel size \(3\)"):
        _load(_make("jamba-moe", tmp_path / "j"), comm=SingleRankCommunicator(), tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match=r"6 heads do not split over 4"):
        _load(_make("falcon-wide", tmp_path / "f"), comm=SingleRankCommunicator(), tp_rank=0, tp_size=4)


def test_checkpoint_tensors_missing_or_extra(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    for name, dropped in (("jamba-moe", "model.layers.0.mamba.dt_proj.bias"),
                          ("jamba-moe", "model.layers.2.mamba.in_proj.weight"),
                          ("jamba-moe", "model.layers.2.feed_forward.router.weight"),
                          ("falcon-plain", "model.layers.1.mamba.in_proj.bias"),
                          ("falcon-plain", "model.layers.2.mamba.conv1d.weight")):
        path = tmp_path / name
        if not path.exists():
            _make(name, path)
        tensors = load_file(str(path / "model.safetensors"))
        model = _load(path)
        model.check_loaded(model.load_weights(tensors.items()))
        with pytest.raises(ValueError, match=rf"checkpoint is missing 1 tensors.*{dropped.replace('.', '[.]')}"):
            model.check_loaded(model.load_weights([(n, t) for n, t in tensors.items() if n != dropped]))
    with pytest.raises(ValueError, match=r"mamba\.norm\.weight.*has no place"):  # falcon-plain: no gated norm
        model.load_weights([("model.layers.0.mamba.norm.weight", torch.ones(32))])
    with pytest.raises(ValueError, match=r"in_proj.*10 rows"):  # rows that are not z, x, B, C and dt
        model.load_weights([("model.layers.0.mamba.in_proj.weight", torch.zeros(10, 32))])
    jamba = _load(tmp_path / "jamba-moe")
    with pytest.raises(ValueError, match=r"in_proj.*10 rows, expected 128 \(64 \+ 64\)"):  # not x then z
        jamba.load_weights([("model.layers.0.mamba.in_proj.weight", torch.zeros(10, 32))])
    with pytest.raises(ValueError, match=r"A_log.*\(64, 4\)"):
        jamba.load_weights([("model.layers.0.mamba.A_log", torch.zeros(64, 4))])
    with pytest.raises(ValueError, match=r"mamba\.dt_layer_norm\.weight.*has no place"):
        jamba.load_weights([("model.layers.0.mamba.dt_layer_norm.weight", torch.ones(2))])


# ---- the engine ----------------------------------------------------------------------------

# 10-40 s each on 2 cores (transformers' generate is most of it): one of each under the fast set
ENGINE_BATCHED = [_param(c, {"falcon-mup"}) for c in sorted(CASES)]
ENGINE_CHUNKED = [_param(c, {"jamba-moe"}) for c in sorted(CASES)]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]


def _assert_parity(path: Path, prompts: list[list[int]], outs: list[Any]) -> None:
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def _assert_all_free(llm: LLM) -> None:
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("case", ENGINE_BATCHED, indirect=True)
def test_greedy_batched_and_alone(case: Path) -> None:
    llm = LLM(model=str(case), device="cpu", max_model_len=128, block_size=4)
    prompts = _prompts(0, [1, 4, 9, 17, 30])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _assert_parity(case, prompts, outs)
    alone = llm.generate([{"prompt_token_ids": prompts[-2]}], GREEDY, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[-2].outputs[0].token_ids
    _assert_all_free(llm)


@pytest.mark.parametrize("case", ENGINE_CHUNKED, indirect=True)
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
    path = _make("jamba-moe", tmp_path / "m")
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, tensor_parallel_size=2,
              max_num_batched_tokens=16)
    prompts = _prompts(2, [5, 13, 26])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        _assert_parity(path, prompts, outs)
    finally:
        llm.engine.shutdown()
