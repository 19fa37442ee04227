"""LoRA adapters on hybrid models (issue 45): PEFT adapters made by peft itself on the attention
and MLP layers of tiny random-weight LFM2, Qwen3-Next, Qwen3.5, Granite 4.0-H, Bamba,
Nemotron-H, Falcon-H1 and Jamba models, each named as that architecture names its modules
(LFM2's ``self_attn.out_proj`` and ``w1``/``w2``/``w3``, Qwen3-Next's gated ``q_proj`` of 2H
heads, Granite's fused ``shared_mlp.input_linear``, Nemotron-H's gate-free ``up_proj``).

- the adapter checks go by the model's own layers (`LoRATargets`): no layer inside a recurrent
  mixer is adaptable; the attention + MLP adapter loads and fits its model (and not another
  family's); an adapter on a recurrent mixer's projections (Mamba's in_proj, Gated DeltaNet's
  in_proj_qkvz, LFM2's convolution) is refused naming the module;
- greedy ids through `portside.LLM` with the adapter (beside the base model in one batch, chunked
  prefill) equal transformers + peft's, and differ from the base model's; a refused adapter is
  the request's ValueError and the engine serves on; tensor parallelism 2 (slow).

peft 0.21 turns ``gate_proj``/``up_proj``/``down_proj`` targets on a ``qwen3_next`` model into
its experts' parameters (transformers 5's fused experts), dense layers included, so Qwen3-Next's
adapter covers its (gated) attention, and Qwen3.5 (the same model class, whose model type peft
leaves alone) covers the MLP too.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from portside import LLM, LoRARequest, SamplingParams
from portside.lora.peft import load_peft_adapter, validate_against
from portside.lora.targets import LoRATargets, recurrent_mixers
from portside.testing.tiny import hf_greedy, make_tiny_lora
from portside.testing.tiny_hybrid import make_tiny_hybrid

pytest.importorskip("peft")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")


def _ssm_ranges(model: torch.nn.Module) -> None:
    """Mamba-2 decays, dt biases and D in their usual ranges (widened weights leave them odd)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.linspace(1, 8, p.numel())).reshape(p.shape))
        elif name.endswith("dt_bias"):
            p.copy_(torch.linspace(-3, 0.5, p.numel()).reshape(p.shape))
        elif name.endswith(".D"):
            p.copy_(torch.linspace(0.5, 1.5, p.numel()).reshape(p.shape))


class Family(NamedTuple):
    config_class: str
    architecture: str
    config: dict[str, Any]
    targets: tuple[str, ...]  # the adapter's: attention and MLP
    recurrent: tuple[str, ...]  # target_modules hitting a recurrent mixer only
    mixer: str  # the mixer's class, named in the refusal


_MAMBA2 = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=8, mamba_d_state=8,
               mamba_n_groups=2, post_init=_ssm_ranges)
_QWEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             intermediate_size=96)
FAMILIES: dict[str, Family] = {
    # conv / attention / conv / attention; GQA; the FFN width auto-adjusted
    "lfm2": Family("Lfm2Config", "Lfm2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, block_multiple_of=16, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_hidden_layers=4, conv_L_cache=3),
        ("q_proj", "k_proj", "v_proj", "self_attn.out_proj", "w1", "w2", "w3"), ("in_proj", "out_proj"), "ShortConv"),
    # gated attention first (q_proj: query and gate per head), two Gated DeltaNet layers; MQA, half rotary
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _QWEN, num_experts=0, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        ATTENTION, ("in_proj_qkvz", "in_proj_ba"), "GatedDeltaNet"),
    # Qwen3.5's split projections; linear / attention alternating; MHA
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _QWEN, seed=2, num_key_value_heads=4, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=3), ATTENTION + GATED_MLP, ("in_proj_qkv", "out_proj"), "GatedDeltaNet"),
    # Granite 4.0-H dense: the shared MLP's gate and up rows fused in input_linear; attention last, no rope
    "granite": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        _MAMBA2, seed=4, shared_intermediate_size=64, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"], num_local_experts=0,
        position_embedding_type=None, residual_multiplier=0.7),
        ATTENTION + ("shared_mlp.input_linear", "shared_mlp.output_linear"), ("in_proj",), "Mamba2Mixer"),
    # attention in the middle of 3 layers, half rotary
    "bamba": Family("BambaConfig", "BambaForCausalLM", dict(
        _MAMBA2, seed=1, num_hidden_layers=3, attn_layer_indices=[1]), ATTENTION + GATED_MLP, ("in_proj",),
        "Mamba2Mixer"),
    # M - * -: relu^2 MLPs (up_proj and down_proj, no gate), position-free attention
    "nemotron_h": Family("NemotronHConfig", "NemotronHForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, mlp_hidden_act="relu2", seed=6,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=1, conv_kernel=3, post_init=_ssm_ranges),
        ATTENTION + ("up_proj", "down_proj"), ("in_proj",), "Mamba2Mixer"),
    # attention and Mamba-2 side by side in every layer; biases; MQA
    "falcon_h1": Family("FalconH1Config", "FalconH1ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=512, seed=2, num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=8, mamba_d_head=4,
        mamba_d_state=4, mamba_n_groups=4, mamba_d_conv=2, mamba_rms_norm=False, mamba_proj_bias=True,
        projectors_bias=False, attention_bias=True, mlp_bias=True, post_init=_ssm_ranges),
        ATTENTION + GATED_MLP, ("in_proj",), "Mamba2Mixer"),
    # Mamba-1 layers; attention in layers 1 and 3; experts in layers 0 and 2 (fused parameters in
    # transformers 5, so peft adapts the dense layers' MLPs only)
    "jamba": Family("JambaConfig", "JambaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, num_hidden_layers=4,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, use_mamba_kernels=False),
        ATTENTION + GATED_MLP, ("x_proj", "dt_proj"), "Mamba1Mixer"),
}
SLOW = {"falcon_h1", "jamba"}  # covered fast by the same checks on the other families
ENGINE_FAST = {"lfm2", "qwen3_next", "qwen3_5"}

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _param(name: str, fast: set[str]) -> Any:
    return pytest.param(name, marks=() if name in fast else pytest.mark.slow, id=name)


class Built(NamedTuple):
    base: Path
    adapter: Path  # attention and MLP
    recurrent: Path  # a recurrent mixer's projections
    family: Family


@functools.cache
def _built(name: str, root: Path) -> Built:
    family = FAMILIES[name]
    kwargs = dict(family.config)
    seed, post_init = kwargs.pop("seed", 0), kwargs.pop("post_init", None)
    base = make_tiny_hybrid(root / name, family.config_class, family.architecture, seed=seed, post_init=post_init,
                            **kwargs)
    adapter = make_tiny_lora(base, root / f"{name}-lora", r=8, alpha=16, target_modules=family.targets, seed=1)
    recurrent = make_tiny_lora(base, root / f"{name}-recurrent", r=4, alpha=8, target_modules=family.recurrent, seed=2)
    return Built(base, adapter, recurrent, family)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_hybrid")


def _adapted_modules(adapter: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        return {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in f.keys()}


# ---- the checks, by the model's own layers ------------------------------------------------------


@pytest.mark.parametrize("name", [_param(n, set(FAMILIES) - SLOW) for n in FAMILIES])
def test_adapter_checks_follow_the_models_layers(name: str, root: Path) -> None:
    built = _built(name, root)
    targets = LoRATargets.for_folder(built.base)
    mixers = tuple(f"{m}." for m in recurrent_mixers(targets.model))
    assert mixers and targets.layers and not any(n.startswith(mixers) for n in targets.layers)
    assert any(".self_attn." in n for n in targets.layers)
    # attention and MLP: every module peft adapted loads, sized as the layer it lands in
    adapter = load_peft_adapter(built.adapter, max_rank=8, targets=targets)
    assert set(adapter.weights) == _adapted_modules(built.adapter)
    assert {n.rsplit(".", 1)[-1] for n in adapter.weights} == {t.rsplit(".", 1)[-1] for t in built.family.targets}
    if name == "qwen3_next":  # the gated attention's q_proj: each head's query, then its gate
        assert adapter.weights["model.layers.0.self_attn.q_proj"][1].shape == (2 * 2 * 32, 8)
    config = json.loads((built.base / "config.json").read_text())
    validate_against(adapter, config)
    # a recurrent mixer's projections: refused naming the module, by the engine's check and by config
    refused = sorted(_adapted_modules(built.recurrent))[0]
    message = (rf"LoRA adapter {re.escape(str(built.recurrent))}: .*{re.escape(refused)} is a projection of layer \d+'s "
               rf"recurrent mixer \({built.family.mixer}\).*; LoRA covers the attention and MLP layers only; train with "
               rf"target_modules that name only attention and MLP projections")
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(built.recurrent, max_rank=8, targets=targets)


def test_an_adapter_for_another_model_is_refused(root: Path) -> None:
    """Checked against a model the config describes (built on the meta device): other sizes, and
    another family's module names."""
    lfm2, qwen = _built("lfm2", root), _built("qwen3_5", root)
    adapter = load_peft_adapter(lfm2.adapter, max_rank=8, targets=LoRATargets.for_folder(lfm2.base))
    config = json.loads((lfm2.base / "config.json").read_text())
    another = r"LoRA adapter .*: this adapter was trained for another model \(.*"
    with pytest.raises(ValueError, match=another + r"model.layers.0.feed_forward.w1 maps 64 -> 64, the model's 64 -> 96"):
        validate_against(adapter, {**config, "intermediate_size": 144})
    with pytest.raises(ValueError, match=another + r"model.layers.1.self_attn.k_proj maps 64 -> 32, the model's 64 -> 16"):
        validate_against(adapter, {**config, "num_attention_heads": 8})  # head_dim 8
    with pytest.raises(ValueError, match=another + r"model.layers.0.feed_forward.w1: qwen3_5_text has no such module"):
        validate_against(adapter, json.loads((qwen.base / "config.json").read_text()))
    with pytest.raises(ValueError, match=another + r"model.layers.0.mlp.down_proj: lfm2 has no such module"):
        load_peft_adapter(qwen.adapter, max_rank=8, targets=LoRATargets.for_folder(lfm2.base))


# ---- through the engine, against transformers + peft --------------------------------------------


@functools.cache
def _peft_model(base: str, adapter: str) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()


@torch.no_grad()
def _peft_greedy(base: Path, adapter: Path, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = _peft_model(str(base), str(adapter)).generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]


def _check(llm: LLM, built: Built, lora: LoRARequest, prompts: list[list[int]]) -> None:
    """The adapter's requests beside the base model's in one batch: peft's ids, and not the base model's."""
    loras = [lora if i % 2 == 0 else None for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras, use_tqdm=False)
    for prompt, lr, out in zip(prompts, loras, outs, strict=True):
        got, base = out.outputs[0].token_ids, hf_greedy(built.base, prompt, MAX_TOKENS)
        if lr is None:
            assert got == base, f"base model, prompt of {len(prompt)} tokens"
        else:
            assert got == _peft_greedy(built.base, built.adapter, prompt), f"adapter, prompt of {len(prompt)} tokens"
            assert got != base, "the adapter changes nothing: the test cannot fail"


@pytest.mark.parametrize("name", [_param(n, ENGINE_FAST) for n in FAMILIES])
def test_greedy_ids_equal_peft(name: str, root: Path) -> None:
    """Chunked prefill (8-token steps) over 4-token blocks; then a refused adapter is the request's
    ValueError naming the module, and the engine serves on."""
    built = _built(name, root)
    llm = LLM(model=str(built.base), device="cpu", max_model_len=64, block_size=4, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_num_batched_tokens=8)
    lora = LoRARequest("attention-mlp", 1, str(built.adapter))
    prompts = _prompts(3, [11, 6, 19])
    _check(llm, built, lora, prompts)
    refused = LoRARequest("recurrent", 2, str(built.recurrent))
    with pytest.raises(ValueError, match=rf"recurrent.*: model\.layers\.\d+\.\S+ is a projection of layer \d+'s "
                                         rf"recurrent mixer \({built.family.mixer}\)"):
        llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY, lora_request=refused, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    again = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora_request=lora, use_tqdm=False)
    assert again[0].outputs[0].token_ids == _peft_greedy(built.base, built.adapter, prompts[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lfm2", "granite"])
def test_tensor_parallel(name: str, root: Path) -> None:
    """Two tensor-parallel ranks (worker processes): B's rows of the column-parallel projections
    (fused parts, Granite's input_linear split into gate and up) and A's columns of the
    row-parallel ones cut as the base weights are."""
    built = _built(name, root)
    llm = LLM(model=str(built.base), device="cpu", max_model_len=64, block_size=4, tensor_parallel_size=2,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        _check(llm, built, LoRARequest("attention-mlp", 1, str(built.adapter)), _prompts(4, [9, 14, 5]))
    finally:
        llm.shutdown()
