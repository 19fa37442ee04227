"""Tiny random-weight models and a locally trained tokenizer, for tests.

Everything here is built in a second or two, deterministically, without a network:

- `make_tiny_tokenizer(path)`: a ~400-token byte-level BPE trained on a built-in English text,
  wrapped as a `transformers.PreTrainedTokenizerFast` with ChatML special tokens and template.
- `make_tiny_model(path, arch=...)`: a Hugging Face folder (config.json, safetensors, tokenizer)
  whose weights `transformers` itself initialises (then re-drawn wider so that greedy decoding
  does not collapse onto one token).
- `hf_greedy(path, prompt_ids, n)`: the oracle: transformers' greedy `generate` in fp32.
- `make_tiny_lora(model_dir, out_dir)`: a random LoRA adapter for such a model, made and saved
  by `peft` itself.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "make_tiny_tokenizer",
    "make_tiny_model",
    "hf_greedy",
    "hf_logits",
    "make_tiny_gguf",
    "make_tiny_lora",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The harbour town woke early. Fishing boats slipped out past the lighthouse while the bakers
lit their ovens, and the smell of fresh bread drifted along the quay. By seven the market was
full: traders called out the price of apples, cheese, rope and lamp oil, and children ran
between the stalls with their dogs.

A ship arrived from the south in the afternoon. Her captain, a tall woman with a grey coat,
asked the harbour master where she could find a carpenter, because the storm had cracked her
mast. He pointed to a small workshop behind the church. "Ask for Thomas," he said. "He is slow,
but his work will outlast the both of us."

What is the capital of France? The capital of France is Paris. What is the largest ocean? The
Pacific Ocean is the largest. How many days are there in a week? There are seven days in a
week. Can you help me write a letter? Of course, I would be glad to help you write a letter.

Engines, servers and schedulers process requests in batches. Each request has a prompt, a
number of tokens to generate, and a set of sampling parameters such as the temperature, top-k
and top-p. The scheduler decides which requests run in each step, and the model computes the
next token for every running sequence at once. Memory for keys and values is split into
blocks, so that sequences of different lengths can share one pool without waste.

In winter the town grew quiet. Snow covered the roofs, the boats stayed in the harbour, and
people gathered in the tavern to tell stories about the sea: of whales and waves, of lost
ships and lucky returns, of the old lighthouse keeper who could read the weather in the clouds.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Punctuation: , . ; : ! ? ( ) [ ] { } - " ' / @ #.
"""

TINY_ARCHS: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# Per tiny arch: the transformers config class and what its tiny shape sets beyond the common
# ones (experts: 4 of them, top-2, each half the dense MLP's width).
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, norm_topk_prob=True, **_MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(shared_expert_intermediate_size=96, use_sliding_window=False, **_MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=8.0)),
    "gemma2": ("Gemma2Config", dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                                    hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        num_hidden_layers=3,
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "default", "rope_theta": 100000.0}})),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
}


# Qwen-style markers a tokenizer may add (`added_tokens=`): reasoning and hermes tool calls
QWEN_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# ChatML with hermes-style tools, as Qwen2.5 / Qwen3 templates render them (tools listed in the
# system turn, calls as <tool_call> JSON, results as tool turns)
HERMES_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions. Signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> to call one.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 400, added_tokens: tuple[str, ...] = (),
                        chat_template: str = CHATML_TEMPLATE) -> Any:
    """Train a byte-level BPE on the built-in corpus, save it as a HF tokenizer at `path`.

    Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1), ``<|im_end|>``
    (eos, id 2); ChatML chat template; no BOS. `added_tokens` (e.g. `QWEN_MARKERS`) are added
    as single, non-special tokens after the trained ones. Returns the `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    if added_tokens:
        hf_tok.add_tokens(list(added_tokens))
    hf_tok.chat_template = chat_template
    Path(path).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(path))
    return hf_tok


def _hf_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, overrides: dict[str, Any]) -> Any:
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    if arch not in _TINY_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; use one of {sorted(TINY_ARCHS)}")
    cls_name, arch_kwargs = _TINY_CONFIGS[arch]
    kwargs.update(arch_kwargs)
    kwargs.update(overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [TINY_ARCHS[arch]]
    return config


@torch.no_grad()
def _widen_init(model: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw every weight wider than HF's default init (std 0.02 makes every logit ~equal, so
    greedy decoding repeats one token). Norm weights are ~1 (but not exactly, so loading them
    is tested); biases are small."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(std * noise)


def make_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    init_std: float = 0.25,
    max_shard_size: int | str | None = None,
    added_tokens: tuple[str, ...] = (),
    chat_template: str = CHATML_TEMPLATE,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight HF model folder at `path` and return it.

    Shape: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, intermediate 128, vocab =
    the tiny tokenizer's, max_position_embeddings 512, fp32. `arch` is "llama", "mistral"
    (explicit head_dim, no sliding window) or "qwen2" (qkv bias). `config_overrides` go to the
    transformers config class (e.g. ``tie_word_embeddings=True``, ``head_dim=32``,
    ``num_hidden_layers=4``, ``rope_parameters={...}``). `max_shard_size` (e.g. ``"100KB"``)
    writes sharded safetensors with an index. `added_tokens` / `chat_template`: as
    `make_tiny_tokenizer` (the vocabulary grows by the added tokens).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tiny_tokenizer(path, added_tokens=added_tokens, chat_template=chat_template)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = _hf_config(arch, len(tok), eos_id, pad_id, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _widen_init(model, init_std, seed)
    if config.tie_word_embeddings:  # the re-draw must not untie the shared tensor
        model.tie_weights()
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    return path


@functools.lru_cache(maxsize=8)
def _load_hf(path: str, mtime: float) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def _hf_model(path: str | os.PathLike) -> Any:
    p = Path(path)
    stamp = max(f.stat().st_mtime for f in p.iterdir())
    return _load_hf(str(p), stamp)


def hf_greedy(
    path: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
    **generate_kwargs: Any,
) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` (new tokens only), in fp32.

    EOS is ignored unless `eos_token_id` is given (then generation stops after emitting it).
    `generate_kwargs` go to `generate` (e.g. ``repetition_penalty``). Results are remembered per
    checkpoint (and its files' mtime) for the process: the parity tests ask for the same prompts'
    continuations many times (each block size, budget and cache setting), and transformers'
    generate is most of their time.
    """
    p = Path(path)
    stamp = max(f.stat().st_mtime for f in p.iterdir())
    try:
        key = (str(p), stamp, tuple(prompt_ids), max_new_tokens, eos_token_id, tuple(sorted(generate_kwargs.items())))
        hash(key)
    except TypeError:  # an unhashable generate kwarg: not remembered
        return _hf_greedy(p, prompt_ids, max_new_tokens, eos_token_id, **generate_kwargs)
    if key not in _HF_GREEDY:
        if len(_HF_GREEDY) >= 4096:
            _HF_GREEDY.clear()
        _HF_GREEDY[key] = tuple(_hf_greedy(p, prompt_ids, max_new_tokens, eos_token_id, **generate_kwargs))
    return list(_HF_GREEDY[key])


_HF_GREEDY: dict[tuple[Any, ...], tuple[int, ...]] = {}


@torch.no_grad()
def _hf_greedy(
    path: Path, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None, **generate_kwargs: Any
) -> list[int]:
    model = _hf_model(path)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
        temperature=None,
        top_p=None,
        top_k=None,
        **generate_kwargs,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_logits(path: str | os.PathLike, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(prompt_ids), vocab] for a single prompt."""
    model = _hf_model(path)
    return model(torch.tensor([prompt_ids], dtype=torch.long)).logits[0].float()


LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's fused projections


def make_draft_model(target: str | os.PathLike, path: str | os.PathLike, noise_std: float = 0.01, seed: int = 0,
                     num_layers: int | None = None) -> Path:
    """A draft model for `target` at `path`: its folder (tokenizer included) with every weight
    perturbed by Gaussian noise of `noise_std` (0: an exact copy) and, given `num_layers`, only its
    first layers kept. On the tiny models noise 0.01 makes a draft whose proposals the target
    accepts at every depth, about a third of them."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(path)
    shutil.copytree(target, path, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(path.glob("*.safetensors")):
        weights = load_file(f)
        if num_layers is not None:
            weights = {k: v for k, v in weights.items()
                       if not (m := re.match(r".*\.layers\.(\d+)\.", k)) or int(m.group(1)) < num_layers}
        save_file({k: v + noise_std * torch.randn(v.shape, generator=g).to(v.dtype) if noise_std else v
                   for k, v in weights.items()}, f, metadata={"format": "pt"})
    if num_layers is not None:
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = num_layers
        (path / "config.json").write_text(json.dumps(config, indent=2))
        for index in path.glob("*.safetensors.index.json"):
            data = json.loads(index.read_text())
            data["weight_map"] = {k: v for k, v in data["weight_map"].items()
                                  if not (m := re.match(r".*\.layers\.(\d+)\.", k)) or int(m.group(1)) < num_layers}
            index.write_text(json.dumps(data, indent=2))
    return path


def make_tiny_lora(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    alpha: int = 16,
    target_modules: tuple[str, ...] = LLAMA_LORA_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    safe_serialization: bool = True,
    **extra_config: Any,
) -> Path:
    """Write a random PEFT LoRA adapter for the tiny model at `model_dir` into `out_dir`; return it.

    `peft` builds it (`LoraConfig(r=r, lora_alpha=alpha, target_modules=..., use_rslora=...,
    **extra_config)`, e.g. ``rank_pattern=``, ``alpha_pattern=``, ``modules_to_save=``) and saves
    it with `save_pretrained` (``adapter_model.bin`` when `safe_serialization` is false). A and B
    are then re-drawn from `seed`: A ~ N(0, 1/in), B ~ N(0, 0.25/r), so that the update
    scaling * B A is about half the size of the base weights at the default r and alpha (greedy
    tokens change within a few steps, logits stay finite). Every name in `target_modules` must
    name a module of the model (Phi-3 fuses its projections: use `PHI3_LORA_TARGETS`).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # not cached: peft edits it
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    absent = [t for t in target_modules if t.rsplit(".", 1)[-1] not in present]
    if absent:
        raise ValueError(f"{model.config.model_type} has no module named {absent}")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0, init_lora_weights=False, **extra_config)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_embedding_A." in name:  # [r, in]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif ".lora_B." in name or ".lora_embedding_B." in name:  # [out, r]
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / math.sqrt(p.shape[1]))
    out = Path(out_dir)
    peft_model.save_pretrained(str(out), safe_serialization=safe_serialization)
    return out


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The folder's config.json as a dict (for tests that inspect what was written)."""
    return json.loads((Path(path) / "config.json").read_text())


# HF architecture -> the GGUF architecture llama.cpp's converter writes it as
_GGUF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def make_tiny_gguf(
    hf_dir: str | os.PathLike, out_path: str | os.PathLike, qtype: str = "F32",
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """Write a GGUF file from a tiny HF folder the way llama.cpp's converter (convert_hf_to_gguf.py)
    does, for every architecture it writes (Mistral and Mixtral as "llama"); returns `out_path`.

    As the converter: llama.cpp tensor names (gguf's own name map), llama's q/k rows permuted for
    its rotary layout, each layer's experts stacked into one [E, rows, cols] tensor per
    projection, Gemma's norm weights stored as 1 + w, Phi-3's longrope factors as tensors, its
    metadata keys; 2-D+ weights as `qtype` ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", and the K-quants
    "Q4_K", "Q5_K", "Q6_K" through `portside.testing.gguf_quants`; norms, biases and routers stay
    F32; rows that are no whole number of blocks fall back to F16 as in the converter).
    `tensor_types` overrides the type per GGUF tensor kind, as llama.cpp's mixes do (Q4_K_M keeps
    ``{"attn_v": "Q6_K", "ffn_down": "Q6_K"}``). The tokenizer is written as "gpt2" (byte-level BPE) with the chat
    template. Raises ValueError for a config the file could not carry (what the converter drops
    and llama.cpp assumes otherwise, e.g. Gemma's query_pre_attn_scalar).
    """
    import gguf
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = read_config(hf_dir)
    arch = _GGUF_ARCHS.get(cfg["architectures"][0])
    if arch is None:
        raise ValueError(f"make_tiny_gguf writes {sorted(_GGUF_ARCHS)}, not {cfg['architectures'][0]!r}")
    dropped = _gguf_drops(cfg, arch)
    if dropped:
        raise ValueError(f"a {arch} GGUF file cannot carry {'; '.join(dropped)}")
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_gguf_params(writer, cfg, arch, qtype)
    _write_gguf_vocab(writer, hf_dir)
    from portside.testing.gguf_quants import K_QUANTS, quantize_k

    for name, w in _gguf_tensors(cfg, arch, load_file(str(hf_dir / "model.safetensors"))):
        keep_f32 = w.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or "ffn_gate_inp" in name
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        wanted = "F32" if keep_f32 else (tensor_types or {}).get(kind, qtype)
        dtype = getattr(gguf.GGMLQuantizationType, wanted)
        try:
            if wanted in K_QUANTS:
                if w.shape[-1] % 256:
                    raise gguf.QuantError(f"{name}: {w.shape[-1]} columns")
                data = quantize_k(w, wanted)
            else:
                data = gguf.quants.quantize(w, dtype)
        except gguf.QuantError:  # rows not a multiple of the block: the converter falls back to F16
            dtype = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(w, dtype)
        writer.add_tensor(name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _gguf_drops(cfg: dict[str, Any], arch: str) -> list[str]:
    """What of `cfg` a GGUF file of `arch` does not carry, where llama.cpp assumes otherwise."""
    from portside.model.gguf_loader import _NORM_TOPK

    out = []
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if arch in ("gemma2", "gemma3"):
        pattern, big = (2, layers == 46) if arch == "gemma2" else (6, layers == 62)
        scalar = hidden // heads if big else cfg["head_dim"]
        if cfg.get("query_pre_attn_scalar", scalar) != scalar:
            out.append(f"query_pre_attn_scalar {cfg['query_pre_attn_scalar']} (llama.cpp: {scalar})")
        types = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(layers)]
        if cfg.get("sliding_window") and cfg.get("layer_types", types) != types:
            out.append(f"layer_types {cfg['layer_types']} (llama.cpp: every {pattern}th layer global)")
    if arch == "gemma2" and not cfg.get("tie_word_embeddings"):
        out.append("an untied lm_head (the converter drops it)")
    if arch == "olmoe" and cfg["rms_norm_eps"] != 1e-5:
        out.append(f"rms_norm_eps {cfg['rms_norm_eps']} (the converter writes 1e-5)")
    if arch == "olmoe" and cfg.get("clip_qkv"):
        out.append(f"clip_qkv {cfg['clip_qkv']}")
    if arch in _NORM_TOPK and bool(cfg.get("norm_topk_prob")) != _NORM_TOPK[arch]:
        out.append(f"norm_topk_prob {cfg.get('norm_topk_prob')} (llama.cpp: {_NORM_TOPK[arch]})")
    if arch == "llama" and cfg.get("sliding_window"):
        out.append(f"sliding_window {cfg['sliding_window']}")
    return out


def _write_gguf_params(writer: Any, cfg: dict[str, Any], arch: str, qtype: str) -> None:
    """The hyper-parameter keys the converter writes for `arch`."""
    import gguf

    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch != "gemma2":
        writer.add_rope_freq_base(float(full.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    kind = full.get("rope_type")
    if kind in ("linear", "yarn") and arch not in ("gemma2", "phi3"):  # these two write their own keys
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(full["factor"])
    if kind == "yarn" and arch not in ("gemma2", "phi3"):
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if full.get(key) is not None:
                add(full[key])
    if cfg.get("num_local_experts") or cfg.get("num_experts"):
        writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3" and cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        original = cfg.get("original_max_position_embeddings") or full["original_max_position_embeddings"]
        partial = full.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(int(partial * hidden) // heads)
        writer.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: none
        if full.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}" + ("_M" if qtype in ("Q4_K", "Q5_K") else "")
    writer.add_file_type(gguf.LlamaFileType[file_type])


def _write_gguf_vocab(writer: Any, hf_dir: Path) -> None:
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template") or (
        (hf_dir / "chat_template.jinja").read_text() if (hf_dir / "chat_template.jinja").is_file() else None
    )
    if template:
        writer.add_chat_template(template)


_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")


def _gguf_tensors(cfg: dict[str, Any], arch: str, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
    """(GGUF name, float32 array) for every tensor the converter writes, changed as it changes them."""
    import gguf
    import numpy as np

    from portside.model.gguf_loader import permute_qk

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])

    def gguf_name(hf: str) -> str:
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf!r} in the {arch} architecture")
        return name

    experts: dict[str, dict[int, Any]] = {}
    for name, tensor in tensors.items():
        w = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            w = permute_qk(w, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            w = permute_qk(w, cfg["num_key_value_heads"])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp's norm multiplies by the weight, Gemma's by 1 + weight
        m = _HF_EXPERT.fullmatch(name)
        if m:  # stacked once the layer's experts are all read: [E, rows, cols]
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
        else:
            yield gguf_name(name), w
    for name, parts in experts.items():
        yield gguf_name(name), np.stack([parts[e] for e in sorted(parts)])
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)
