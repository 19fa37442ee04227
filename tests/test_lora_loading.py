"""PEFT LoRA adapters as data (issue 21): `LoRARequest`, `load_peft_adapter`, `validate_against`.

Adapters are made by `peft` itself (`make_tiny_lora`) on tiny random models; what the loader
returns is checked against peft's own modules (its tensors and per-module scaling) and, through a
hand merge W + B_folded A, against peft's logits in transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from portside.lora.peft import AdapterNotFoundError, LoRAAdapter, load_peft_adapter, validate_against
from portside.testing.tiny import LLAMA_LORA_TARGETS, PHI3_LORA_TARGETS, make_tiny_lora, make_tiny_model

pytest.importorskip("peft")

TARGETS = {"llama": LLAMA_LORA_TARGETS, "qwen2": LLAMA_LORA_TARGETS, "phi3": PHI3_LORA_TARGETS}


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen2, tmp_path_factory) -> dict[str, Path]:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "phi3": make_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), "phi3")}


@pytest.fixture(scope="module")
def llama_adapter(models, tmp_path_factory) -> Path:
    return make_tiny_lora(models["llama"], tmp_path_factory.mktemp("lora") / "plain")


def _peft_model(model_dir: Path, adapter_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def _assert_matches_peft(adapter: LoRAAdapter, model_dir: Path, adapter_dir: Path) -> None:
    """Every module's A and folded B equal peft's lora_A and lora_B times peft's own scaling."""
    peft_model = _peft_model(model_dir, adapter_dir)
    lora_modules = {n: m for n, m in peft_model.base_model.model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert set(adapter.weights) == set(lora_modules)
    for name, (a, b) in adapter.weights.items():
        module = lora_modules[name]
        scale = module.scaling["default"]
        torch.testing.assert_close(a, module.lora_A["default"].weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(b, module.lora_B["default"].weight.detach() * scale)
        assert adapter.scalings[name] == pytest.approx(scale)
        assert a.shape == (module.r["default"], module.in_features)
        assert b.shape == (module.out_features, module.r["default"])
    assert adapter.rank == max(m.r["default"] for m in lora_modules.values())


# --- LoRARequest ---------------------------------------------------------------------------------


def test_lora_request_as_vllm_names_it():
    import portside
    from portside.lora.request import LoRARequest

    assert portside.LoRARequest is LoRARequest and "LoRARequest" in portside.__all__
    req = LoRARequest("sql", 3, "/adapters/sql", base_model_name="tiny")
    assert (req.adapter_id, req.name, req.path, req.base_model_name) == (3, "sql", "/adapters/sql", "tiny")
    assert LoRARequest("sql", 1).lora_path == "" and LoRARequest("sql", 1).base_model_name is None
    assert req == LoRARequest("other-name", 3) and hash(req) == hash(LoRARequest("x", 3, "/elsewhere"))
    assert req != LoRARequest("sql", 4, "/adapters/sql")
    assert len({req, LoRARequest("sql", 3), LoRARequest("b", 5)}) == 2
    with pytest.raises(AttributeError):
        req.lora_int_id = 9  # type: ignore[misc]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
            LoRARequest("a", bad)
    with pytest.raises(ValueError, match="must be an int"):
        LoRARequest("a", True)


# --- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_names_shapes_and_scaling_match_peft(arch, models, tmp_path):
    adapter_dir = make_tiny_lora(models[arch], tmp_path / "a", r=8, alpha=16, target_modules=TARGETS[arch])
    adapter = load_peft_adapter(adapter_dir, max_rank=8)
    assert adapter.rank == 8 and adapter.scaling == 2.0 and adapter.path == str(adapter_dir)
    assert adapter.target_modules == tuple(sorted(TARGETS[arch]))
    layers = 2 * len(TARGETS[arch])
    assert len(adapter.weights) == layers
    assert all(name.startswith("model.layers.") for name in adapter.weights)
    # the file's tensors, prefix removed, B times alpha / r
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for name, (a, b) in adapter.weights.items():
        torch.testing.assert_close(a, saved[f"base_model.model.{name}.lora_A.weight"])
        torch.testing.assert_close(b, saved[f"base_model.model.{name}.lora_B.weight"] * 2.0)
    _assert_matches_peft(adapter, models[arch], adapter_dir)
    validate_against(adapter, json.loads((models[arch] / "config.json").read_text()))


def test_fused_phi3_shapes(models, tmp_path):
    adapter = load_peft_adapter(make_tiny_lora(models["phi3"], tmp_path / "a", target_modules=PHI3_LORA_TARGETS), max_rank=8)
    a, b = adapter.weights["model.layers.0.self_attn.qkv_proj"]
    assert a.shape == (8, 64) and b.shape == (4 * 16 + 2 * 2 * 16, 8)  # q + k + v rows
    a, b = adapter.weights["model.layers.1.mlp.gate_up_proj"]
    assert a.shape == (8, 64) and b.shape == (2 * 128, 8)


def test_rslora_scaling(models, tmp_path):
    adapter_dir = make_tiny_lora(models["llama"], tmp_path / "a", r=4, alpha=8, use_rslora=True)
    adapter = load_peft_adapter(adapter_dir, max_rank=4)
    assert adapter.scaling == pytest.approx(8 / 4**0.5)
    _assert_matches_peft(adapter, models["llama"], adapter_dir)


@pytest.mark.parametrize("rslora", [False, True])
def test_rank_and_alpha_patterns(rslora, models, tmp_path):
    rank_pattern = {"layers.1.self_attn.q_proj": 4, "down_proj": 16, r"layers\.0\.mlp\.up_proj": 2}
    alpha_pattern = {"v_proj": 4, "model.layers.1.self_attn.q_proj": 32}
    adapter_dir = make_tiny_lora(models["llama"], tmp_path / "a", r=8, alpha=16, use_rslora=rslora,
                                 rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    adapter = load_peft_adapter(adapter_dir, max_rank=16)
    assert adapter.rank == 16
    assert adapter.scaling == pytest.approx(16 / 8**0.5 if rslora else 2.0)
    w = adapter.weights
    assert w["model.layers.1.self_attn.q_proj"][0].shape[0] == 4
    assert w["model.layers.0.self_attn.q_proj"][0].shape[0] == 8
    assert w["model.layers.0.mlp.down_proj"][0].shape[0] == 16
    assert w["model.layers.0.mlp.up_proj"][0].shape[0] == 2 and w["model.layers.1.mlp.up_proj"][0].shape[0] == 8
    root = (lambda r: r**0.5) if rslora else (lambda r: r)
    assert adapter.scalings["model.layers.1.self_attn.q_proj"] == pytest.approx(32 / root(4))
    assert adapter.scalings["model.layers.0.self_attn.v_proj"] == pytest.approx(4 / root(8))
    assert adapter.scalings["model.layers.0.mlp.down_proj"] == pytest.approx(16 / root(16))
    _assert_matches_peft(adapter, models["llama"], adapter_dir)
    with pytest.raises(ValueError, match=r"rank 16 is above the maximum LoRA rank 8; raise --max-lora-rank"):
        load_peft_adapter(adapter_dir, max_rank=8)


def test_bin_weights_and_dtype(models, llama_adapter, tmp_path):
    bin_dir = make_tiny_lora(models["llama"], tmp_path / "bin", safe_serialization=False)
    assert (bin_dir / "adapter_model.bin").is_file() and not (bin_dir / "adapter_model.safetensors").exists()
    from_bin, from_st = load_peft_adapter(bin_dir, max_rank=8), load_peft_adapter(llama_adapter, max_rank=8)
    for name, (a, b) in from_st.weights.items():
        torch.testing.assert_close(from_bin.weights[name][0], a, rtol=0, atol=0)
        torch.testing.assert_close(from_bin.weights[name][1], b, rtol=0, atol=0)
    half = load_peft_adapter(llama_adapter, max_rank=8, dtype=torch.bfloat16)
    for name, (a, b) in half.weights.items():
        assert a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()
        torch.testing.assert_close(b, from_st.weights[name][1].to(torch.bfloat16))
    assert half.nbytes * 2 == from_st.nbytes


def test_hand_merged_weights_give_peft_logits(models, tmp_path):
    """W + B_folded A in the base model reproduces transformers + peft: the folding is right."""
    from transformers import AutoModelForCausalLM

    cases = [
        ("llama", dict(r=8, alpha=16)),
        ("llama", dict(r=4, alpha=8, use_rslora=True, rank_pattern={"o_proj": 8}, alpha_pattern={"layers.0.mlp.down_proj": 3})),
        ("qwen2", dict(r=8, alpha=32)),
        ("phi3", dict(r=8, alpha=16, target_modules=PHI3_LORA_TARGETS)),
    ]
    ids = torch.tensor([[5, 17, 42, 99, 123, 7, 250, 31]])
    for i, (arch, kwargs) in enumerate(cases):
        adapter_dir = make_tiny_lora(models[arch], tmp_path / f"a{i}", seed=i, **kwargs)
        adapter = load_peft_adapter(adapter_dir, max_rank=8)
        merged = AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32).eval()
        with torch.no_grad():
            base_logits = merged(ids).logits
            for name, (a, b) in adapter.weights.items():
                merged.get_submodule(name).weight += b @ a
            merged_logits = merged(ids).logits
            peft_logits = _peft_model(models[arch], adapter_dir)(ids).logits
        assert torch.isfinite(peft_logits).all()
        torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-4)
        # the adapter changes what greedy decoding picks, visibly
        assert (base_logits.argmax(-1) != peft_logits.argmax(-1)).float().mean() >= 0.25, (arch, kwargs)


def test_make_tiny_lora_checks_target_names(models, tmp_path):
    with pytest.raises(ValueError, match=r"phi3 has no module named \['q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj'\]"):
        make_tiny_lora(models["phi3"], tmp_path / "a")


# --- refusals ------------------------------------------------------------------------------------


def _edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of the adapter at `src` with its config updated by `config` and its tensors
    replaced by `tensors(dict) -> dict`."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        file = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(file))), str(file))
    return dst


def _renamed(old: str, new: str):
    return lambda sd: {k.replace(old, new): v for k, v in sd.items()}


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
CONFIG_REFUSALS = [
    ({"peft_type": "PREFIX_TUNING"}, r"peft_type is 'PREFIX_TUNING', and only LORA adapters are supported"),
    ({"use_dora": True}, r"DoRA \(use_dora=True\) is not supported; train a plain LoRA adapter"),
    ({"bias": "lora_only"}, r"bias='lora_only' trains the base model's biases.*; train with bias='none'"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save \['lm_head'\] holds full copies.*; train without modules_to_save"),
    ({"fan_in_fan_out": True}, r"fan_in_fan_out=True .* is not supported"),
    ({"lora_bias": True}, r"a bias on lora_B \(lora_bias=True\) is not supported; train without lora_bias"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"LoRA on embeddings or the LM head is not supported \(target module 'embed_tokens'\)"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"LoRA on embeddings or the LM head is not supported"),
    ({"target_modules": ["q_proj", "dense"]}, r"target module 'dense' is not supported; train with target_modules among q_proj, k_proj"),
    ({"rank_pattern": {"layers.0.self_attn.q_proj": 4}}, r"model.layers.0.self_attn.q_proj has rank 8 in its tensors but adapter_config.json gives it r=4"),
]


@pytest.mark.parametrize("config,message", CONFIG_REFUSALS, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(CONFIG_REFUSALS)])
def test_config_refusals(config, message, llama_adapter, tmp_path):
    bad = _edited(llama_adapter, tmp_path / "bad", config=config)
    with pytest.raises(ValueError, match=message) as info:
        load_peft_adapter(bad, max_rank=64)
    assert str(info.value).startswith(f"LoRA adapter {bad}: ")


TENSOR_REFUSALS = [
    (_renamed(".lora_A.weight", ".lora_A.default.weight"), r"tensor '.*lora_A.default.weight' is not named as peft names LoRA weights"),
    (_renamed("self_attn.q_proj", "self_attn.rotary"), r"module 'model.layers.0.self_attn.rotary' is not supported"),
    (_renamed("model.layers.0.self_attn.q_proj", "model.embed_tokens"), r"LoRA on embeddings or the LM head is not supported"),
    (lambda sd: {**sd, "base_model.model.model.embed_tokens.lora_embedding_A": sd[f"{Q0}.lora_A.weight"].clone()},
     r"LoRA on embeddings or the LM head is not supported \(tensor "),
    (lambda sd: {k: v for k, v in sd.items() if k != f"{Q0}.lora_B.weight"}, r"q_proj has no lora_B.weight"),
    (lambda sd: {**sd, f"{Q0}.lora_B.weight": sd[f"{Q0}.lora_B.weight"][:, :4].contiguous()},
     r"q_proj: lora_A \(8, 64\) and lora_B \(64, 4\) do not fit \(A is \[r, in\], B is \[out, r\]\)"),
    (lambda sd: {}, r"holds no LoRA tensors"),
]


@pytest.mark.parametrize("edit,message", TENSOR_REFUSALS)
def test_tensor_refusals(edit, message, llama_adapter, tmp_path):
    bad = _edited(llama_adapter, tmp_path / "bad", tensors=edit)
    with pytest.raises(ValueError, match=message) as info:
        load_peft_adapter(bad, max_rank=64)
    assert str(info.value).startswith(f"LoRA adapter {bad}: ")


def test_refuses_real_peft_adapters_it_cannot_serve(models, tmp_path):
    """What peft itself writes for the unsupported options."""
    llama = models["llama"]
    cases = [
        (dict(use_dora=True), "DoRA"),
        (dict(bias="all"), "bias='all'"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=("embed_tokens", "q_proj")), "LoRA on embeddings or the LM head is not supported"),
        (dict(target_modules=("lm_head",)), "LoRA on embeddings or the LM head is not supported"),
    ]
    for i, (kwargs, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            load_peft_adapter(make_tiny_lora(llama, tmp_path / str(i), **kwargs), max_rank=64)
    with pytest.raises(ValueError, match=r"rank 8 is above the maximum LoRA rank 4; raise --max-lora-rank \(max_lora_rank\) to 8"):
        load_peft_adapter(make_tiny_lora(llama, tmp_path / "r8"), max_rank=4)


def test_missing_and_corrupt_files(llama_adapter, tmp_path):
    with pytest.raises(AdapterNotFoundError, match=r"LoRA adapter .*nowhere: no such folder"):
        load_peft_adapter(tmp_path / "nowhere", max_rank=8)
    no_config = _edited(llama_adapter, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterNotFoundError, match="no adapter_config.json; give the folder peft's save_pretrained wrote"):
        load_peft_adapter(no_config, max_rank=8)
    no_weights = _edited(llama_adapter, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterNotFoundError, match=r"no adapter_model.safetensors \(or adapter_model.bin\)"):
        load_peft_adapter(no_weights, max_rank=8)
    corrupt = _edited(llama_adapter, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="its weights are unreadable"):
        load_peft_adapter(corrupt, max_rank=8)
    (corrupt / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="adapter_config.json is unreadable"):
        load_peft_adapter(corrupt, max_rank=8)


# --- validate_against ----------------------------------------------------------------------------


def test_validate_against_catches_another_model(models, llama_adapter, tmp_path):
    from transformers import AutoConfig

    adapter = load_peft_adapter(llama_adapter, max_rank=8)
    validate_against(adapter, AutoConfig.from_pretrained(str(models["llama"])))
    base = json.loads((models["llama"] / "config.json").read_text())
    mismatches = [
        (dict(intermediate_size=256), r"model.layers.0.mlp.gate_proj maps 64 -> 128, the model's 64 -> 256"),
        (dict(hidden_size=128), r"model.layers.0.mlp.down_proj maps 128 -> 64, the model's 128 -> 128"),
        (dict(num_key_value_heads=4), r"model.layers.0.self_attn.k_proj maps 64 -> 32, the model's 64 -> 64"),
        (dict(head_dim=32), r"q_proj maps 64 -> 64, the model's 64 -> 128"),
        (dict(num_hidden_layers=1), r"model.layers.1.\w+.\w+: the model has 1 layers"),
        (dict(num_experts=4, model_type="qwen2_moe"), r"layer 0's MLP is a mixture of experts"),
    ]
    for change, message in mismatches:
        with pytest.raises(ValueError, match=r"LoRA adapter .*: this adapter was trained for another model \(.*" + message):
            validate_against(adapter, {**base, **change})
    with pytest.raises(ValueError, match="phi3 has fused qkv_proj / gate_up_proj"):
        validate_against(adapter, AutoConfig.from_pretrained(str(models["phi3"])))
    phi3 = load_peft_adapter(make_tiny_lora(models["phi3"], tmp_path / "p", target_modules=PHI3_LORA_TARGETS), max_rank=8)
    validate_against(phi3, json.loads((models["phi3"] / "config.json").read_text()))
    with pytest.raises(ValueError, match="llama has separate q/k/v and gate/up projections"):
        validate_against(phi3, base)
    # a multimodal config's text_config is the one that counts
    validate_against(adapter, {"model_type": "llava", "text_config": base})
