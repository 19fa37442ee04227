"""LFM2 and LFM2-MoE (short convolutions beside attention) against transformers, on tiny
random-weight models of several shapes (convolution lengths 2-4, MHA/GQA/MQA, attention first,
in the middle or last, conv biases, tied embeddings, FFN sizing with and without
block_auto_adjust_ff_dim, sigmoid-routed experts with an expert bias):

- prompt logits, prefilled whole and in chunks then decoded, through a forward context built by
  hand (core's reference attention and causal_conv1d), fp32 and bf16, and with two
  tensor-parallel ranks (threads with real collectives);
- greedy token ids through `portside.LLM`, batched with prompts of different lengths and alone,
  with chunked prefill, preemption and prefix-cache hits in one run;
- a checkpoint whose layer_types names a layer portside lacks: ValueError naming the layer type
  and the architecture, `portside generate` / `portside serve` exit 2 with that message;
- slow: every shape through the engine, tensor and pipeline parallelism 2 over worker processes, a LoRA
  adapter on the attention projections (equal to transformers + peft), structured output (a
  JSON schema) through the real HTTP server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, LoRARequest, SamplingParams
from portside.attention.reference import ReferenceAttentionBackend
from portside.config import ModelConfig
from portside.contract import Communicator, ForwardContext, RecurrentMetadata
from portside.model.hybrid_layers import check_config_layer_types, check_layer_types
from portside.model.registry import load_model
from portside.runner.inputs import attention_metadata
from portside.testing.tiny import hf_greedy, hf_logits, make_tiny_lora
from portside.testing.tiny_hybrid import make_tiny_hybrid

CONV, ATTN = "conv", "full_attention"
SMALL = dict(hidden_size=64, intermediate_size=96, block_multiple_of=16, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)


def _expert_bias(model: torch.nn.Module) -> None:
    """LFM2-MoE's expert bias (a buffer transformers leaves at zero): big enough to change the choice."""
    gen = torch.Generator().manual_seed(5)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))


# name -> (config class, architecture, config kwargs)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {**SMALL, "layer_types": [CONV, ATTN, CONV, ATTN], "conv_L_cache": 3}),
    # L_cache 2, attention first, MHA of head_dim 8, conv biases, tied embeddings, FFN width as configured
    "lfm2-k2-attn-first": ("Lfm2Config", "Lfm2ForCausalLM", {
        "hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 6, "num_key_value_heads": 6,
        "layer_types": [ATTN, CONV, CONV], "conv_L_cache": 2, "conv_bias": True, "tie_word_embeddings": True,
        "block_auto_adjust_ff_dim": False, "seed": 1, "max_position_embeddings": 256}),
    # L_cache 4, MQA, attention last, FFN multiplier 1.5 rounded up to 8
    "lfm2-k4-mqa-attn-last": ("Lfm2Config", "Lfm2ForCausalLM", {
        **SMALL, "num_attention_heads": 8, "num_key_value_heads": 1, "layer_types": [CONV, CONV, CONV, ATTN],
        "conv_L_cache": 4, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 8, "seed": 2}),
    # a dense first layer, then 4 experts (top-2, renormalised, scaled 1.5, biased choice)
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {
        **SMALL, "layer_types": [CONV, ATTN, CONV], "conv_L_cache": 3, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "num_dense_layers": 1, "routed_scaling_factor": 1.5, "seed": 3,
        "post_init": _expert_bias}),
}
FAST_ENGINE_CASES = {"lfm2"}

PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens
LOGIT_TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 0.15, "rtol": 0.05}}
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _make(path: Path, name: str) -> Path:
    config_class, arch, kwargs = CASES[name]
    kwargs = dict(kwargs, num_hidden_layers=len(kwargs["layer_types"]))
    return make_tiny_hybrid(path, config_class, arch, seed=kwargs.pop("seed", 0), post_init=kwargs.pop("post_init", None),
                            **kwargs)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("lfm2"), "lfm2")


class HandSequence:
    """One sequence through a private paged KV cache and a recurrent state slot (slot 1 of 3),
    the forward context built by hand as the runner builds it."""

    def __init__(self, model: Any, block_size: int = 4, max_tokens: int = 128) -> None:
        self.model, self.backend, self.block_size = model, ReferenceAttentionBackend(), block_size
        spec, state = model.kv_cache_spec(), model.state_spec()
        num_blocks = -(-max_tokens // block_size)
        shape = self.backend.cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        self.kv = [torch.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]
        self.states = [tuple(torch.zeros((3, *s), dtype=d) for s, d in zip(state.shapes, state.dtypes))
                       for _ in range(state.num_layers)]
        self.table = list(reversed(range(num_blocks)))
        self.num_cached = 0

    @torch.no_grad()
    def forward(self, ids: list[int]) -> torch.Tensor:
        n, start, bs = len(ids), self.num_cached, self.block_size
        slots = [self.table[p // bs] * bs + p % bs for p in range(start, start + n)]
        decode = int(n == 1 and start > 0)
        meta = self.backend.prepare(attention_metadata([self.table], slots, [0, n], [start + n], decode, bs,
                                                       torch.device("cpu")))
        rec = RecurrentMetadata(state_slots=torch.tensor([1]), has_initial_state=torch.tensor([start > 0]),
                                query_start_loc=torch.tensor([0, n], dtype=torch.int32), query_start_loc_cpu=[0, n],
                                state_slots_cpu=[1], has_initial_state_cpu=[start > 0], num_decodes=decode)
        ctx = ForwardContext(backend=self.backend, kv_caches=self.kv, metadata=meta, state_caches=self.states,
                             recurrent=rec)
        hidden = self.model(torch.tensor(ids), torch.arange(start, start + n), ctx)
        self.num_cached += n
        return self.model.compute_logits(hidden)

    def logits(self, ids: list[int], chunks: list[int]) -> torch.Tensor:
        """Logits of every token of `ids`, computed in chunks of the given sizes (the rest one at a time)."""
        out, i = [], 0
        for size in chunks:
            out.append(self.forward(ids[i : i + size]))
            i += size
        out += [self.forward([t]) for t in ids[i:]]
        return torch.cat(out)


def _hf_bf16_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def test_prompt_logits_whole_chunked_and_decoded(case: Path) -> None:
    model = load_model(ModelConfig(path=str(case), max_model_len=256), torch.device("cpu"))
    assert model.state_spec().kind == "short_conv" and model.kv_cache_spec().num_layers == \
        model.config.hf_config.layer_types.count(ATTN)
    expected = hf_logits(case, PROMPT)
    torch.testing.assert_close(HandSequence(model).logits(PROMPT, [len(PROMPT)]), expected, **LOGIT_TOLERANCE[torch.float32])
    # chunks across block boundaries and a chunk shorter than the convolution, then one token a step
    torch.testing.assert_close(HandSequence(model).logits(PROMPT, [7, 1, 2, 6]), expected, **LOGIT_TOLERANCE[torch.float32])


def test_prompt_logits_bf16(lfm2: Path) -> None:
    model = load_model(ModelConfig(path=str(lfm2), max_model_len=256, dtype=torch.bfloat16), torch.device("cpu"))
    assert model.state_spec().dtypes == (torch.bfloat16,)
    logits = HandSequence(model).logits(PROMPT, [10, 13])
    torch.testing.assert_close(logits, _hf_bf16_logits(lfm2, PROMPT), **LOGIT_TOLERANCE[torch.bfloat16])


def test_tensor_parallel_logits_equal_transformers(tmp_path: Path) -> None:
    """Two ranks (threads with real collectives): each holds half of the convolution channels
    (its slice of B, C and x, of the taps and of the state) and half of the heads."""
    from test_models import run_ranks

    path = _make(tmp_path / "moe", "lfm2_moe")
    expected = hf_logits(path, PROMPT)

    def rank(comm: Communicator, r: int) -> Any:
        model = load_model(ModelConfig(path=str(path), max_model_len=256), torch.device("cpu"), comm, r, 2)
        return (model, HandSequence(model).logits(PROMPT, [9, 10]))

    results = run_ranks(2, rank)
    for r in range(2):
        model, logits = results[r]
        torch.testing.assert_close(logits, expected, **LOGIT_TOLERANCE[torch.float32])
        assert model.state_spec().shapes == ((32, 2),)  # 64 channels over 2 ranks, L_cache 3


def test_tensor_parallel_sizes_that_do_not_divide_are_refused(lfm2: Path) -> None:
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM over 3 tensor-parallel ranks: hidden_size \(the short "
                                         r"convolutions' channels\) 64 is not divisible by 3"):
        load_model(ModelConfig(path=str(lfm2), max_model_len=256), torch.device("cpu"), None, 0, 3)


# ---- through the engine ------------------------------------------------------------------------


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]


def _assert_parity(path: Path, prompts: list[list[int]], outs: list[Any]) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def _assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


ENGINE_CASES = [c if c in FAST_ENGINE_CASES else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]


@pytest.mark.parametrize("case", ENGINE_CASES, indirect=True)
def test_greedy_batched_and_alone(case: Path) -> None:
    llm = LLM(model=str(case), device="cpu", max_model_len=128, block_size=4)
    prompts = _prompts(0, [1, 2, 5, 9, 17, 30, 41])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _assert_parity(case, prompts, outs)
    alone = llm.generate([{"prompt_token_ids": prompts[-1]}], GREEDY, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("case", ENGINE_CASES, indirect=True)
def test_greedy_chunked_prefill_preemption_and_prefix_hits(case: Path) -> None:
    """A 10-token budget splits prompts longer than a chunk across steps, mixed with decodes; 20
    blocks of 4 tokens cannot hold 5 sequences of ~35 tokens, so some are preempted and
    recomputed; a second batch repeats prompts and extends their prefixes, and its hits restore
    the convolution states saved at block boundaries."""
    llm = LLM(model=str(case), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=20,
              max_num_batched_tokens=10, enable_chunked_prefill=True, enable_prefix_caching=True)
    prompts = _prompts(1, [23, 11, 19, 25, 14])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    _assert_parity(case, prompts, outs)
    again = [prompts[3], prompts[0][:21] + [7, 8, 9], prompts[2] + [11, 12]]
    outs = llm.generate([{"prompt_token_ids": p} for p in again], GREEDY, use_tqdm=False)
    _assert_parity(case, again, outs)
    assert outs[0].num_cached_tokens >= 20 and sum(o.num_cached_tokens for o in outs[1:]) > 0
    _assert_all_blocks_free(llm)


# ---- a layer type portside lacks ---------------------------------------------------------------


def _with_layer_type(src: Path, dst: Path, layer: int, kind: str) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["layer_types"][layer] = kind
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_check_layer_types_names_the_type_and_the_architecture() -> None:
    check_layer_types("Lfm2ForCausalLM", [CONV, ATTN], (CONV, ATTN))
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM: layer 1 has layer type 'mamba'.*'conv', 'full_attention'"):
        check_layer_types("Lfm2ForCausalLM", [CONV, "mamba", ATTN], (CONV, ATTN))
    # a raw config whose type transformers would refuse too (Qwen3-Next with a Mamba layer)
    check_config_layer_types({"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention", ATTN]})
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM: layer 1 has layer type 'mamba2'"):
        check_config_layer_types({"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention", "mamba2"]})


def test_unknown_layer_type_fails_at_load(lfm2: Path, tmp_path: Path) -> None:
    """'sliding_attention' passes transformers' config but LFM2 has no such layer; 'mamba_mixer'
    is refused before transformers reads the config (whose own error is a traceback)."""
    known_elsewhere = _with_layer_type(lfm2, tmp_path / "sliding", 2, "sliding_attention")
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM: layer 2 has layer type 'sliding_attention'"):
        load_model(ModelConfig(path=str(known_elsewhere), max_model_len=256), torch.device("cpu"))
    unknown = _with_layer_type(lfm2, tmp_path / "mamba", 1, "mamba_mixer")
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM: layer 1 has layer type 'mamba_mixer'"):
        LLM(model=str(unknown), device="cpu", max_model_len=64)


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "portside.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("kind", ["sliding_attention", pytest.param("mamba_mixer", marks=pytest.mark.slow)])
def test_cli_generate_exits_2_on_unknown_layer_type(lfm2: Path, tmp_path: Path, kind: str) -> None:
    model = _with_layer_type(lfm2, tmp_path / "bad", 2, kind)
    result = _cli("generate", "--model", str(model), "--device", "cpu", "--max-tokens", "2", "hello")
    assert result.returncode == 2, result.stderr
    assert f"Lfm2ForCausalLM: layer 2 has layer type {kind!r}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_serve_exits_2_on_unknown_layer_type(lfm2: Path, tmp_path: Path) -> None:
    model = _with_layer_type(lfm2, tmp_path / "bad", 0, "sliding_attention")
    result = _cli("serve", str(model), "--device", "cpu", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert "Lfm2ForCausalLM: layer 0 has layer type 'sliding_attention'" in result.stderr


# ---- tensor parallelism over processes, LoRA, the server (slow) ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_engine(lfm2: Path, parallel: dict[str, int]) -> None:
    """Worker processes: two tensor-parallel ranks, or two pipeline stages (layers 0-1 and 2-3,
    each with its own attention and convolution layers)."""
    llm = LLM(model=str(lfm2), device="cpu", max_model_len=128, block_size=4, num_kv_blocks=96,
              max_num_batched_tokens=16, **parallel)
    try:
        prompts = _prompts(2, [5, 13, 30])
        _assert_parity(lfm2, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    finally:
        llm.engine.executor.shutdown()


@torch.no_grad()
def _peft_greedy(base: Path, adapter: Path, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(adapter))
    ids = torch.tensor([prompt])
    out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_lora_on_attention_equals_peft(lfm2: Path, tmp_path: Path) -> None:
    """An adapter on q/k/v (LFM2 names them as Llama does) beside the base model in one batch, then
    one on LFM2's own MLP names (w1/w2/w3: checked against the model's layers, `portside.lora.targets`)."""
    adapter = make_tiny_lora(lfm2, tmp_path / "qkv", target_modules=("q_proj", "k_proj", "v_proj"))
    llm = LLM(model=str(lfm2), device="cpu", max_model_len=64, block_size=4, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_num_batched_tokens=8)
    prompts = _prompts(3, [11, 6, 19])
    lora = LoRARequest("qkv", 1, str(adapter))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=[lora, None, lora], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _peft_greedy(lfm2, adapter, prompts[0])
    assert outs[1].outputs[0].token_ids == hf_greedy(lfm2, prompts[1], MAX_TOKENS)
    assert outs[2].outputs[0].token_ids == _peft_greedy(lfm2, adapter, prompts[2])
    assert outs[0].outputs[0].token_ids != hf_greedy(lfm2, prompts[0], MAX_TOKENS)  # the adapter matters
    mlp = make_tiny_lora(lfm2, tmp_path / "mlp", target_modules=("w1", "w2", "w3"))
    out = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY, lora_request=LoRARequest("mlp", 2, str(mlp)),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == _peft_greedy(lfm2, mlp, prompts[1])


@pytest.mark.slow
def test_structured_output_through_the_server(lfm2: Path, tmp_path: Path) -> None:
    """The real `portside serve` on LFM2: a JSON schema constrains the (random) model's output."""
    import jsonschema
    import openai
    from server.server_process import ServerProcess

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "kind": {"enum": ["a", "b"]}},
              "required": ["name", "size", "kind"], "additionalProperties": False}
    proc = ServerProcess(lfm2, tmp_path / "server.log", "--max-model-len", "256", "--block-size", "4",
                         "--num-kv-blocks", "400", "--max-num-batched-tokens", "16")
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for _ in range(2):  # the second one's prompt hits the prefix cache
            resp = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Describe a thing as JSON."}], max_tokens=60,
                temperature=0.0, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
            jsonschema.validate(json.loads(resp.choices[0].message.content or ""), schema)
            assert resp.choices[0].finish_reason == "stop"
        metrics = proc.wait_idle()
        assert sum(v for k, v in metrics.items() if k.startswith("vllm:prefix_cache_hits_total")) > 0
    finally:
        proc.kill()
