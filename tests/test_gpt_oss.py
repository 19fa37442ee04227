"""gpt-oss (`GptOssForCausalLM`) against transformers on tiny random-weight models of several
shapes: 4 to 16 experts with top-1 to top-4, GQA / MHA / MQA, head_dim 16 and 32, windows of 4-8
tokens on alternating (or irregular) layers, learned attention sinks, the clamped SwiGLU with a
tight limit, YaRN rotary; prompts longer than the windows.

- prompt logits through core's reference attention (fp32, and bf16 against transformers in bf16);
- the checkpoint's parts land where they belong (sinks per layer and head, interleaved experts);
- greedy token ids through the cpu engine, batched and alone, with chunked prefill and
  preemption, and with prefix-cache hits; once in the inductor graph mode;
- tensor parallelism over 2 ranks (heads and their sinks, expert intermediate split).
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
from portside.testing.tiny import hf_greedy, hf_logits
from portside.testing.tiny_gpt_oss import make_tiny_gpt_oss

CASES: dict[str, dict[str, Any]] = {
    "e8k2": {},  # 4 layers alternating window 8 / full, 4 heads over 2 KV heads, head_dim 16
    "e4k1-mha-window4": {"seed": 1, "num_local_experts": 4, "num_experts_per_tok": 1, "num_key_value_heads": 4,
                         "sliding_window": 4},
    "e16k4-mqa-hd32-limit2": {"seed": 2, "num_local_experts": 16, "num_experts_per_tok": 4, "num_key_value_heads": 1,
                              "head_dim": 32, "swiglu_limit": 2.0, "num_hidden_layers": 2},
    "e4k3-window5-irregular": {"seed": 3, "num_local_experts": 4, "num_experts_per_tok": 3, "sliding_window": 5,
                               "num_hidden_layers": 3, "swiglu_alpha": 1.2,
                               "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
}
FAST_CASES = {"e8k2", "e16k4-mqa-hd32-limit2"}
LOGIT_TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 0.15, "rtol": 0.05}}
PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=[c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gpt_oss(tmp_path_factory.mktemp(request.param), **CASES[request.param])


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def _load(path: Path, **kw: Any) -> torch.nn.Module:
    return load_model(ModelConfig(path=str(path), **{"max_model_len": 512, **kw}), torch.device("cpu"))


def _hf_bf16_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def test_prompt_logits_match_transformers(case: Path) -> None:
    logits = PagedSequence(_load(case), ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    torch.testing.assert_close(logits, hf_logits(case, PROMPT), **LOGIT_TOLERANCE[torch.float32])


@pytest.mark.parametrize("overrides", [
    {}, pytest.param({"num_local_experts": 16, "num_experts_per_tok": 4, "sliding_window": 5}, marks=pytest.mark.slow)],
    ids=["e8k2", "e16k4-window5"])
def test_bf16_prompt_logits_match_transformers_bf16(overrides: dict[str, Any], tmp_path: Path) -> None:
    """bf16 against transformers in bf16 (its norms kept in fp32, as ours). Weights of std 0.1:
    the wider tiny models amplify bf16's rounding through the layers until both bf16 runs sit
    ~1.5 from the fp32 logits (and from each other), where no tolerance tells a bug apart."""
    path = make_tiny_gpt_oss(tmp_path / "m", init_std=0.1, **overrides)
    logits = PagedSequence(_load(path, dtype=torch.bfloat16), ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    expected = _hf_bf16_logits(path, PROMPT)
    assert (expected - hf_logits(path, PROMPT)).abs().max() < 0.25  # bf16 stays near fp32 at this width
    torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE[torch.bfloat16])


class _NoSinksBackend(ReferenceAttentionBackend):
    """A backend written before sinks (as a plugin's may be): it lists only the older features."""

    features = frozenset({"sliding_window", "logit_softcap"})

    def forward(self, *args: Any, sinks: Any = None, **kw: Any) -> torch.Tensor:
        assert sinks is None, "core passed sinks to a backend that does not list them"
        return super().forward(*args, **kw)


def test_a_backend_without_sinks_runs_through_cores_fallback(tiny_gpt_oss: Path) -> None:
    """Core's fallback (its reference over the backend's write_kv / read_kv) serves the sink
    layers of a backend that does not list "sinks"; greedy decoding equals transformers'."""
    model = _load(tiny_gpt_oss)
    got = PagedSequence(model, _NoSinksBackend(), block_size=4).greedy(PROMPT, MAX_TOKENS, prefill_chunk=7)
    assert got == hf_greedy(tiny_gpt_oss, PROMPT, MAX_TOKENS)


def test_checkpoint_parts_are_where_transformers_has_them(tiny_gpt_oss: Path) -> None:
    """Sinks per layer and head, the router's bias, and expert e's gate / up rows (interleaved in
    the checkpoint) with their biases, down projection and its bias, against transformers' model;
    and the sinks matter (the output without them differs)."""
    from portside.testing.tiny import hf_model

    model, hf = _load(tiny_gpt_oss), hf_model(tiny_gpt_oss)
    for i, (ours, theirs) in enumerate(zip(model.model.layers, hf.model.layers)):
        attn = ours.self_attn
        assert attn.features["sinks"] is attn.sinks and attn.sinks.dtype == torch.float32
        assert attn.features["sliding_window"] == (8 if i % 2 == 0 else None)
        torch.testing.assert_close(attn.sinks, theirs.self_attn.sinks.float(), atol=0, rtol=0)
        torch.testing.assert_close(ours.mlp.router.bias, theirs.mlp.router.bias, atol=0, rtol=0)
        ex, hx = ours.mlp.experts, theirs.mlp.experts
        inter = hx.intermediate_size
        for e in (0, hx.num_experts - 1):
            x = torch.randn(3, 64)
            gate_up = x @ hx.gate_up_proj[e] + hx.gate_up_proj_bias[e]
            ours_gate_up = x @ ex.w13[e].T + ex.w13_bias[e]
            torch.testing.assert_close(ours_gate_up[:, :inter], gate_up[:, ::2])
            torch.testing.assert_close(ours_gate_up[:, inter:], gate_up[:, 1::2])
            h = torch.randn(3, inter)
            torch.testing.assert_close(h @ ex.w2[e].T + ex.w2_bias[e], h @ hx.down_proj[e] + hx.down_proj_bias[e])
    expected = hf_logits(tiny_gpt_oss, PROMPT)
    for layer in model.model.layers:
        layer.self_attn.sinks.fill_(float("-inf"))  # no sink: plain softmax
    without = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    assert (without - expected).abs().max() > 0.1


# engine runs take 5-20 s each on 2 cores: one fast case, the rest under -m slow (CI runs them)
GREEDY_CASES = [c if c == "e8k2" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
SLOW_GREEDY_CASES = [pytest.param(c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("case", GREEDY_CASES, indirect=True)
def test_greedy_parity_batched_and_alone(case: Path) -> None:
    check_batched_and_alone(case)


@pytest.mark.parametrize("case", SLOW_GREEDY_CASES, indirect=True)
def test_greedy_parity_chunked_prefill_and_preemption(case: Path) -> None:
    check_chunked_prefill_and_preemption(case)


def test_prefix_cache_hits(tiny_gpt_oss: Path) -> None:
    check_prefix_cache_hits(tiny_gpt_oss)


@pytest.mark.slow  # compiles the model (~1 min on 2 cores)
def test_greedy_parity_inductor_graph(tiny_gpt_oss: Path) -> None:
    """The inductor graph calls `portside_cpu::attention_sinks` for the sink layers."""
    llm = LLM(model=str(tiny_gpt_oss), device="cpu", max_model_len=128, block_size=8, max_num_batched_tokens=24,
              platform_options={"cpu_graph": "inductor"})  # fmt: skip
    prompts = random_prompts(4, [3, 11, 20, 30])
    for batch in (prompts, prompts[2:3]):
        assert_greedy_parity(tiny_gpt_oss, batch, llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                                                         use_tqdm=False))  # fmt: skip


def test_tensor_parallel_logits_equal_transformers(tmp_path: Path) -> None:
    """Two ranks (threads with real collectives): 4 query heads and their sinks, 2 KV heads, and
    every expert's intermediate dimension split; the experts' output bias added once."""
    from test_models import run_ranks

    path = make_tiny_gpt_oss(tmp_path / "m", seed=4, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)
    expected = hf_logits(path, PROMPT)

    def rank(comm: Communicator, r: int) -> Any:
        model = load_model(ModelConfig(path=str(path), max_model_len=512), torch.device("cpu"), comm, r, 2)
        return model, PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)

    results = run_ranks(2, rank)
    for r, (model, logits) in enumerate(results):
        torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE[torch.float32])
        attn, experts = model.model.layers[0].self_attn, model.model.layers[0].mlp.experts
        assert attn.sinks.shape == (2,) and experts.w13.shape[1] == 32 == 2 * experts.w2.shape[2]
        assert bool((experts.w2_bias == 0).all()) == (r == 1)


@pytest.mark.slow  # builds o200k_harmony (~45 s) and a 201088-token model
def test_tiny_gpt_oss_with_the_harmony_tokenizer(tmp_path: Path) -> None:
    """`make_tiny_gpt_oss(tokenizer_dir=...)`: the released vocabulary size and eos ids, the
    tokenizer beside the weights, and the engine's greedy tokens equal transformers'."""
    from transformers import AutoTokenizer

    from portside.testing.harmony_tokenizer import harmony_tokenizer_dir
    from portside.testing.tiny_gpt_oss import GPT_OSS_VOCAB

    path = make_tiny_gpt_oss(tmp_path / "m", tokenizer_dir=harmony_tokenizer_dir(), num_hidden_layers=2)
    config = _load(path).config
    assert config.vocab_size == GPT_OSS_VOCAB and set(config.eos_token_ids) == {200002, 199999, 200012}
    ids = AutoTokenizer.from_pretrained(str(path)).encode("Hello world, how are you?")
    llm = LLM(model=str(path), device="cpu", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, ids, MAX_TOKENS)


def test_bad_or_missing_sinks_are_named(tiny_gpt_oss: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_gpt_oss, bad)
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.1.self_attn.sinks"] = torch.zeros(5)
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.sinks' \(5,\).*one value per query head \(4\)"):
        _load(bad)
    del weights["model.layers.1.self_attn.sinks"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model.layers.1.self_attn.sinks"):
        _load(bad)
