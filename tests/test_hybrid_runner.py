"""Which graph runner runs a hybrid model (`GraphRunner.supports_recurrent_state`): the cpu eager
runner (op by op, its multi-row linears in oneDNN over prepacked weights) takes hybrid models,
its start-up capture included (the dummy step carries the states, in the scratch slot), also
where a compiling runner (Inductor) was asked for; a platform runner that does not declare it is
replaced by core's eager runner. Greedy ids equal transformers' every way."""

from __future__ import annotations

import pytest

from portside import LLM, SamplingParams
from portside.contract import EagerGraphRunner
from portside.testing.tiny import hf_greedy
from portside.testing.tiny_hybrid import make_tiny_hybrid

PROMPTS = [[5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45], [77, 1, 390, 12, 13, 14, 200]]


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp("lfm2"), "Lfm2Config", "Lfm2ForCausalLM", hidden_size=64,
                            intermediate_size=96, block_multiple_of=16, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, num_hidden_layers=3,
                            layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)


def _run(path, graph: str) -> tuple[object, list[list[int]]]:
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, platform_options={"cpu_graph": graph})
    runner = llm.engine.executor.runner.graph_runner
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return runner, [list(o.outputs[0].token_ids) for o in outs]


def test_the_cpu_eager_runner_runs_hybrid_models(lfm2):
    runner, ids = _run(lfm2, "eager")
    assert type(runner).__module__ == "portside.backends.cpu.graph" and runner.supports_recurrent_state
    assert ids == [hf_greedy(lfm2, p, 8) for p in PROMPTS]


def test_the_cpu_inductor_option_runs_hybrid_models_in_the_eager_runner(lfm2):
    runner, ids = _run(lfm2, "inductor")
    assert type(runner).__name__ == "EagerGraphRunner" and type(runner).__module__ == "portside.backends.cpu.graph"
    assert ids == [hf_greedy(lfm2, p, 8) for p in PROMPTS]


def test_a_runner_without_recurrent_state_support_falls_back_to_core_eager(lfm2, monkeypatch):
    from portside.backends.cpu.graph import EagerGraphRunner as CpuEager

    monkeypatch.setattr(CpuEager, "supports_recurrent_state", False)
    runner, ids = _run(lfm2, "eager")
    assert type(runner) is EagerGraphRunner
    assert ids == [hf_greedy(lfm2, p, 8) for p in PROMPTS]


def test_the_attention_feature_check_reads_hybrid_models(tmp_path, lfm2):
    """A backend that refuses a feature (`AttentionBackend.unsupported_features`) gets each layer's
    features from a hybrid model too (none for a recurrent layer), so the check passes, not crashes."""
    import torch

    from portside.config import ModelConfig
    from portside.contract import Platform
    from portside.model.registry import load_model
    from portside.runner.kv_cache import check_attention_features

    class Refusing:
        name = "refusing"
        unsupported_features = frozenset({"logit_softcap"})

    qwen3_next = make_tiny_hybrid(tmp_path / "qn", "Qwen3NextConfig", "Qwen3NextForCausalLM", hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                                  linear_value_head_dim=8, num_experts=0, layer_types=["linear_attention", "full_attention"])
    for path in (lfm2, qwen3_next):
        model = load_model(ModelConfig(path=str(path)), torch.device("cpu"))
        check_attention_features(model, Platform, Refusing())
