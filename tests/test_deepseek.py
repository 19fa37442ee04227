"""DeepSeek-V2 / V3 (multi-head latent attention, `portside.model.deepseek`) against transformers, on
tiny random-weight models of several shapes: with and without a query LoRA, kv_lora_rank 16-64,
rope dims 4-16, nope dims 8-16, value dims 12-24, 4-8 heads, interleaved (V2, V3 default) and
half-split (V3 ``rope_interleave=False``) rotary, YaRN with its softmax mscale, attention biases;
dense models and experts after 0-1 dense layers (4-16 experts, top-1 to top-4: V2's softmax
greedy and group-limited routing, V3's sigmoid grouped routing with a correction bias, shared
experts, `routed_scaling_factor`).

- prompt logits through a paged latent cache (core's reference `latent_attention`), whole and in
  chunks continuing from the cache, fp32; over 2 tensor-parallel ranks (threads: heads split, the
  latent replicated); through a plugin's attention backend that has no latent kernels (npu_example);
- greedy token ids through `portside.LLM`: batched with chunked prefill and preemption, alone, a
  prefix-cache hit; the cpu graph runners (eager, and inductor, which falls back to eager); n-gram
  speculative decoding; pipeline and tensor parallelism;
- the multi-token-prediction layer's tensors read and kept; refusals (8-bit latent cache, heads
  that do not split, tensors past the MTP layers).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.attention.reference import ReferenceAttentionBackend
from portside.config import ModelConfig
from portside.contract import Communicator, EagerGraphRunner, LatentKVCacheSpec, SingleRankCommunicator
from portside.model.registry import load_model
from portside.testing.paged import PagedSequence
from portside.testing.tiny import hf_greedy, hf_logits
from portside.testing.tiny_deepseek import make_tiny_deepseek

_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=0.707,
             rope_theta=10000.0, beta_fast=32, beta_slow=1)

# name -> (version, overrides of portside.testing.tiny_deepseek.TINY: 4 heads, kv_lora_rank 32, rope 8,
# nope 16, v 12, no query LoRA, dense)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2": ("v2", {}),
    # query LoRA, a wide rope part, nope < rope, v wider than nope; YaRN (mscale on the softmax too)
    "v2-qlora-yarn": ("v2", dict(seed=1, q_lora_rank=16, kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=8,
                                 v_head_dim=24, rope_parameters=_YARN)),
    # 8 heads, a narrow latent, 3 layers, q/kv_a and o biases
    "v3-qlora": ("v3", dict(seed=2, q_lora_rank=24, kv_lora_rank=16, num_attention_heads=8, qk_nope_head_dim=12,
                            v_head_dim=16, num_hidden_layers=3, first_k_dense_replace=3, attention_bias=True)),
    # rotary on halves (rope_interleave False), a wide latent, 4 rope dims
    "v3-halves": ("v3", dict(seed=3, rope_interleave=False, kv_lora_rank=64, qk_rope_head_dim=4, v_head_dim=16)),
    # experts after one dense layer: V2's softmax top-2 of 8 among the best 2 of 4 groups, scaled, 2 shared experts
    "v2-moe-grouped": ("v2", dict(seed=4, q_lora_rank=16, first_k_dense_replace=1, n_routed_experts=8,
                                  num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.5, n_shared_experts=2)),
    # V2's plain softmax top-1 of 4 in every layer
    "v2-moe-greedy": ("v2", dict(seed=5, first_k_dense_replace=0, n_routed_experts=4, num_experts_per_tok=1)),
    # V3's sigmoid routing with a correction bias: top-4 of 16 among the best 2 of 4 groups, renormalised, scaled
    "v3-moe": ("v3", dict(seed=6, q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
                          num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          norm_topk_prob=True)),
}

LOGIT_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _make(name: str, folder: Path) -> Path:
    version, overrides = CASES[name]
    return make_tiny_deepseek(folder, version, **overrides)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def _load(path: Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    return load_model(ModelConfig(path=str(path), max_model_len=256, dtype=dtype), torch.device("cpu"), **kwargs)


def _chunks(model: Any, backend: Any = None) -> torch.Tensor:
    """The prompt in chunks of 5, 1 (a decode), 9 and 8 tokens, each continuing from the cache."""
    seq = PagedSequence(model, backend or ReferenceAttentionBackend(), block_size=4)
    return torch.cat([seq.forward(PROMPT[:5]), seq.forward(PROMPT[5:6]), seq.forward(PROMPT[6:15]),
                      seq.forward(PROMPT[15:])])  # fmt: skip


def test_prompt_logits_whole_and_in_chunks(case: Path) -> None:
    model = _load(case)
    expected = hf_logits(case, PROMPT)
    whole = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    torch.testing.assert_close(whole, expected, **LOGIT_TOLERANCE)
    torch.testing.assert_close(_chunks(model), expected, **LOGIT_TOLERANCE)
    spec = model.kv_cache_spec()
    hf = model.config.hf_config
    assert isinstance(spec, LatentKVCacheSpec) and spec.num_kv_heads == 1
    assert (spec.latent_dim, spec.rope_dim, spec.num_layers) == (hf.kv_lora_rank, hf.qk_rope_head_dim, hf.num_hidden_layers)


def test_bf16_no_further_from_fp32_than_transformers_bf16(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = _make("v3-moe", tmp_path / "m")
    reference = hf_logits(path, PROMPT)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = (hf_bf16(torch.tensor([PROMPT])).logits[0].float() - reference).abs().mean()
    ours = (PagedSequence(_load(path, torch.bfloat16), ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
            - reference).abs().mean()  # fmt: skip
    assert ours <= 1.25 * theirs, (ours, theirs)


@pytest.mark.parametrize("name", ["v2-qlora-yarn", "v3-moe"])
def test_tensor_parallel_logits(name: str, tmp_path: Path) -> None:
    from test_models import run_ranks

    path = _make(name, tmp_path / name)
    expected = hf_logits(path, PROMPT)

    def rank(comm: Communicator, r: int) -> Any:
        model = _load(path, comm=comm, tp_rank=r, tp_size=2)
        return model, _chunks(model)

    whole = _load(path).kv_cache_spec()
    for model, logits in run_ranks(2, rank):
        torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE)
        assert model.kv_cache_spec() == whole  # the latent is replicated, not split
        assert model._layer(0).self_attn.num_heads * 2 == model.config.num_heads


def test_a_plugin_without_latent_kernels_runs_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """plugins/npu_example's attention backend (its own K/V layout, no latent methods) inherits the
    contract's defaults, core's reference."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "plugins" / "npu_example"))
    from portside_npu_example.attention import NpuExampleAttentionBackend

    assert "latent_attention" not in vars(NpuExampleAttentionBackend)
    path = _make("v2", tmp_path / "m")
    torch.testing.assert_close(_chunks(_load(path), NpuExampleAttentionBackend()), hf_logits(path, PROMPT),
                               **LOGIT_TOLERANCE)  # fmt: skip
    sys.modules.pop("portside_npu_example.attention", None)


def test_heads_that_do_not_split_are_refused(tmp_path: Path) -> None:
    path = _make("v2", tmp_path / "m")  # 4 heads
    with pytest.raises(ValueError, match=r"4 attention heads do not split over 3 tensor-parallel ranks"):
        _load(path, comm=SingleRankCommunicator(), tp_rank=0, tp_size=3)


def test_mtp_layer_tensors_are_kept_not_used(tmp_path: Path) -> None:
    """V3's multi-token-prediction layer (`num_nextn_predict_layers`), stored as layer
    num_hidden_layers: its tensors are read into `mtp_weights`; the logits are transformers'."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_deepseek(tmp_path / "m", "v3", num_nextn_predict_layers=1)
    tensors = load_file(str(path / "model.safetensors"))
    mtp = {f"model.layers.2.{n.removeprefix('model.layers.1.')}": t + 1 for n, t in tensors.items()
           if n.startswith("model.layers.1.")}
    mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
                "model.layers.2.hnorm.weight": torch.ones(64), "model.layers.2.shared_head.norm.weight": torch.ones(64)})
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = _load(path)
    assert sorted(model.mtp_weights) == sorted(mtp)
    assert all(torch.equal(model.mtp_weights[n], t) for n, t in mtp.items())
    torch.testing.assert_close(_chunks(model), hf_logits(path, PROMPT), **LOGIT_TOLERANCE)
    with pytest.raises(ValueError, match=r"'model\.layers\.3\.enorm\.weight' has no place.*1 multi-token-prediction"):
        model.load_weights([("model.layers.3.enorm.weight", torch.ones(64))])


# ---- the engine ----------------------------------------------------------------------------

ENGINE_FAST = {"v2", "v3-moe"}
ENGINE_CASES = [c if c in ENGINE_FAST else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]


def _assert_parity(path: Path, prompts: list[list[int]], outs: list[Any]) -> None:
    expected = [hf_greedy(path, prompt, MAX_TOKENS) for prompt in prompts]
    for prompt, out, tokens in zip(prompts, outs, expected, strict=True):
        assert out.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens"
    assert len({t for tokens in expected for t in tokens}) > 2 * len(prompts), "greedy continuations repeat themselves"


@pytest.mark.parametrize("case", ENGINE_CASES, indirect=True)
def test_greedy_batched_chunked_preempted_alone_and_prefix_hit(case: Path) -> None:
    """Prompts of 1-27 tokens batched under a 10-token budget (prompts split over steps beside
    decodes); 16 blocks of 4 tokens cannot hold 5 sequences of up to 37 tokens, so some are
    preempted and recomputed; one prompt again alone; then a prompt sharing an earlier one's
    20-token prefix reads those 5 blocks' latent rows from the prefix cache."""
    llm = LLM(model=str(case), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=10, num_kv_blocks=16)
    prompts = _prompts(1, [1, 23, 11, 27, 14])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    _assert_parity(case, prompts, outs)
    alone = llm.generate([{"prompt_token_ids": prompts[3]}], GREEDY, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    shared = [prompts[3][:20] + [7, 8, 9], prompts[3][:20] + [300, 301]]
    first = llm.generate([{"prompt_token_ids": shared[0]}], GREEDY, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": shared[1]}], GREEDY, use_tqdm=False)
    assert hit[0].num_cached_tokens == 20, hit[0].num_cached_tokens
    _assert_parity(case, shared, first + hit)
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()
    llm.shutdown()


@pytest.mark.parametrize("graph", ["eager", "inductor"])
def test_cpu_graph_runners(graph: str, tmp_path: Path) -> None:
    """The cpu eager runner runs MLA op by op; a compiling runner (inductor), which cuts the model
    at attention calls MLA does not make, is replaced by core's eager runner."""
    path = _make("v2", tmp_path / "m")
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, platform_options={"cpu_graph": graph})
    runner = llm.engine.executor.runner.graph_runner
    prompts = _prompts(3, [11, 7])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.shutdown()
    if graph == "eager":
        assert type(runner).__module__ == "portside.backends.cpu.graph"
    else:
        assert type(runner) is EagerGraphRunner
    _assert_parity(path, prompts, outs)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_an_8bit_latent_cache_is_refused(kv_cache_dtype: str, tmp_path: Path) -> None:
    path = _make("v2", tmp_path / "m")
    with pytest.raises(ValueError, match=rf"--kv-cache-dtype {kv_cache_dtype}\S*: DeepseekV2ForCausalLM uses multi-head "
                                         r"latent attention \(MLA\).*use --kv-cache-dtype auto"):
        LLM(model=str(path), device="cpu", max_model_len=64, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_engine(tmp_path: Path) -> None:
    path = _make("v3-moe", tmp_path / "m")
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, tensor_parallel_size=2,
              max_num_batched_tokens=16)
    prompts = _prompts(2, [5, 13, 26])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        _assert_parity(path, prompts, outs)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_engine(tmp_path: Path) -> None:
    """Two stages: each allocates the latent caches of its own layers; the MTP layer's tensors stay
    with the last stage."""
    path = _make("v3-moe", tmp_path / "m")
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, pipeline_parallel_size=2)
    prompts = _prompts(4, [7, 25])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        _assert_parity(path, prompts, outs)
    finally:
        llm.engine.shutdown()


def test_ngram_speculative_decoding(tmp_path: Path) -> None:
    """Verification steps attend several query tokens per running request over the latent cache."""
    path = _make("v2", tmp_path / "m")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, speculative_config=ngram)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9, 10]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
    llm.shutdown()
