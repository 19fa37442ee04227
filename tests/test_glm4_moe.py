"""GLM-4.5 (`Glm4MoeForCausalLM`) against transformers on tiny random-weight models of several
shapes: 4 to 16 experts, top-1 to top-4, 1 to 4 groups with 1 or 2 kept, one or two shared
experts, correction biases that change choices, norm_topk_prob on and off, routed_scaling_factor;
GQA / MHA / MQA, partial rotary (a quarter, half, all of each head), q/k norms and q/k/v biases on
and off, 0 to 2 dense first layers; the multi-token-prediction layer's tensors in the checkpoint.

- prompt logits through core's reference attention (fp32, and bf16 against transformers in bf16);
- the checkpoint's parts land where they belong, the MTP layer's tensors are kept (and a layer
  past them is refused);
- greedy token ids through the cpu engine, batched and alone, with chunked prefill and
  preemption, and with prefix-cache hits;
- tensor parallelism over 2 ranks (heads, the dense MLP, every routed and shared expert's
  intermediate dimension split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.attention.reference import ReferenceAttentionBackend
from portside.config import ModelConfig
from portside.contract import Communicator
from portside.model.registry import load_model
from portside.testing.engine_parity import (
    assert_greedy_parity,
    check_batched_and_alone,
    check_chunked_prefill_and_preemption,
    check_prefix_cache_hits,
    random_prompts,
)
from portside.testing.paged import PagedSequence
from portside.testing.tiny import hf_logits
from portside.testing.tiny_glm4_moe import make_tiny_glm4_moe

CASES: dict[str, dict[str, Any]] = {
    "e8k2-g2": {},  # 3 layers, the first dense; top-2 within the best of 2 groups; q/k norms, biases, half rotary
    "e16k4-g4t2-mqa-hd32": {"seed": 1, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                            "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.25,
                            "n_shared_experts": 2, "use_qk_norm": False, "first_k_dense_replace": 0,
                            "num_hidden_layers": 2},
    "e4k1-mha-nobias": {"seed": 2, "n_routed_experts": 4, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
                        "num_key_value_heads": 4, "attention_bias": False, "partial_rotary_factor": 1.0,
                        "norm_topk_prob": False, "routed_scaling_factor": 2.5, "first_k_dense_replace": 2,
                        "num_nextn_predict_layers": 0},
    "e12k3-g3t2": {"seed": 3, "n_routed_experts": 12, "num_experts_per_tok": 3, "n_group": 3, "topk_group": 2,
                   "num_nextn_predict_layers": 2},
}  # fmt: skip
FAST_CASES = {"e8k2-g2", "e16k4-g4t2-mqa-hd32"}
LOGIT_TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 0.15, "rtol": 0.05}}
PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=[c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4_moe(tmp_path_factory.mktemp(request.param), **CASES[request.param])


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4_moe(tmp_path_factory.mktemp("glm4_moe"))


def _load(path: Path, **kw: Any) -> torch.nn.Module:
    return load_model(ModelConfig(path=str(path), **{"max_model_len": 512, **kw}), torch.device("cpu"))


def test_prompt_logits_match_transformers(case: Path) -> None:
    logits = PagedSequence(_load(case), ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    torch.testing.assert_close(logits, hf_logits(case, PROMPT), **LOGIT_TOLERANCE[torch.float32])


def test_bf16_prompt_logits_match_transformers_bf16(tmp_path: Path) -> None:
    """bf16 against transformers in bf16 (both keep the router and its bias in fp32)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_glm4_moe(tmp_path / "m", init_std=0.1)
    model = _load(path, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16
    logits = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE[torch.bfloat16])


def test_checkpoint_parts_and_mtp_layers_are_kept(tiny_glm: Path) -> None:
    """q/k/v biases and no o bias, q/k norms, dense then expert layers, the routers in fp32 with
    their correction biases; and every tensor of the MTP layer (model.layers.3.*) kept, unchanged."""
    from safetensors.torch import load_file

    from portside.model.decoder import GatedMLP
    from portside.model.deepseek_moe import DeepseekMoE
    from portside.testing.tiny import hf_model

    model, hf = _load(tiny_glm), hf_model(tiny_glm)
    for i, (ours, theirs) in enumerate(zip(model.model.layers, hf.model.layers, strict=True)):
        attn = ours.self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and attn.qk_norm == "head"
        torch.testing.assert_close(attn.q_norm.weight, theirs.self_attn.q_norm.weight, atol=0, rtol=0)
        assert isinstance(ours.mlp, GatedMLP if i == 0 else DeepseekMoE)
        if i:
            gate = ours.mlp.gate
            assert gate.weight.dtype == torch.float32
            torch.testing.assert_close(gate.e_score_correction_bias, theirs.mlp.gate.e_score_correction_bias, atol=0,
                                       rtol=0)  # fmt: skip
            torch.testing.assert_close(ours.mlp.experts.w2[5], theirs.mlp.experts.down_proj[5], atol=0, rtol=0)
    state = load_file(next(tiny_glm.glob("*.safetensors")))
    mtp = {k: v for k, v in state.items() if k.startswith("model.layers.3.")}
    assert len(mtp) > 40 and "model.layers.3.eh_proj.weight" in mtp
    assert set(model.mtp_weights) == set(mtp)
    for name, t in mtp.items():
        torch.testing.assert_close(model.mtp_weights[name], t, atol=0, rtol=0)


def test_a_layer_past_the_mtp_layers_is_refused(tiny_glm: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_glm, bad)
    f = next(bad.glob("*.safetensors"))
    state = load_file(f)
    state["model.layers.4.enorm.weight"] = torch.ones(64)
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.4\.enorm\.weight.*3 layers and 1 multi-token-prediction"):
        _load(bad)


GREEDY_CASES = [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("case", GREEDY_CASES, indirect=True)
def test_greedy_parity_batched_and_alone(case: Path) -> None:
    check_batched_and_alone(case)


@pytest.mark.parametrize("case", GREEDY_CASES, indirect=True)
def test_greedy_parity_chunked_prefill_and_preemption(case: Path) -> None:
    check_chunked_prefill_and_preemption(case)


def test_prefix_cache_hits(tiny_glm: Path) -> None:
    check_prefix_cache_hits(tiny_glm)


def test_tensor_parallel_logits_equal_transformers(tmp_path: Path) -> None:
    """Two ranks (threads with real collectives): 4 query and 2 KV heads (with their q/k/v
    biases), the dense MLP, and every routed and shared expert's intermediate dimension split."""
    from test_models import run_ranks

    path = make_tiny_glm4_moe(tmp_path / "m", seed=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                              topk_group=2, n_shared_experts=2)  # fmt: skip
    expected = hf_logits(path, PROMPT)

    def rank(comm: Communicator, r: int) -> Any:
        model = load_model(ModelConfig(path=str(path), max_model_len=512), torch.device("cpu"), comm, r, 2)
        return model, PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)

    for model, logits in run_ranks(2, rank):
        torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE[torch.float32])
        moe = model.model.layers[1].mlp
        assert moe.experts.w13.shape[1] == 32 and moe.shared_experts.down_proj.weight.shape[1] == 32
        assert model.model.layers[0].self_attn.num_heads == 2


def test_online_int8_experts_match_the_rounded_checkpoint(tiny_glm: Path, tmp_path: Path) -> None:
    """--quantization int8: the shared and routed experts through `quantized_moe_experts` (with the
    grouped, bias-corrected routing of `select_experts`), the attention and dense MLP through
    `quantized_linear`; the routers stay fp32. Greedy ids equal transformers' on the checkpoint
    rounded the same way."""
    from test_quant_formats import _write_online_oracle

    oracle = _write_online_oracle(tiny_glm, tmp_path / "oracle", "int8")
    llm = LLM(model=str(tiny_glm), device="cpu", max_model_len=128, block_size=4, quantization="int8")
    moe = llm.engine.executor.runner.model.model.layers[1].mlp
    assert moe.experts.quant13 is not None and moe.shared_experts.down_proj.quant is not None
    assert moe.gate.quant is None and moe.gate.weight.dtype == torch.float32
    prompts = random_prompts(5, [3, 12, 20])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_parity(oracle, prompts, outs)
