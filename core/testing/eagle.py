"""Random-weight EAGLE heads for a tiny target, written in the layouts their authors publish (read
by `portside.model.eagle`): EAGLE-3 as `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` (``midlayer.*``,
``fc``, ``norm``, ``lm_head`` over a draft vocabulary, ``d2t`` / ``t2d``; safetensors) or with
the speculators' ``layers.0.*`` names; EAGLE-1 as `yuhuili/EAGLE-llama2-chat-7B` (``fc`` with a
bias, ``layers.0.*`` without the first norm, ``pytorch_model.bin``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["make_eagle_head"]


def _layer(cfg: dict[str, Any], in_size: int, gen: torch.Generator, std: float, eagle3: bool) -> dict[str, torch.Tensor]:
    h, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]

    def w(*shape: int) -> torch.Tensor:
        return std * torch.randn(*shape, generator=gen)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    t = {"self_attn.q_proj.weight": w(heads * hd, in_size), "self_attn.k_proj.weight": w(kvh * hd, in_size),
         "self_attn.v_proj.weight": w(kvh * hd, in_size), "self_attn.o_proj.weight": w(h, heads * hd),
         "mlp.gate_proj.weight": w(inter, h), "mlp.up_proj.weight": w(inter, h), "mlp.down_proj.weight": w(h, inter),
         "post_attention_layernorm.weight": norm()}
    if eagle3:
        t["input_layernorm.weight"] = norm()
        t["hidden_norm.weight"] = norm()
    return t


def make_eagle_head(target: str | os.PathLike, path: str | os.PathLike, method: str = "eagle3", *, seed: int = 0,
                    std: float = 0.25, draft_vocab: list[int] | None = None, aux_layer_ids: list[int] | None = None,
                    layout: str = "yuhuili", with_embed: bool = False, successors: dict[int, int] | None = None,
                    **config_overrides: Any) -> Path:
    """An EAGLE (`method` "eagle") or EAGLE-3 ("eagle3") head for the model folder `target`, at
    `path`. Shapes follow the target's config (`config_overrides` change the head's, e.g.
    ``target_hidden_size`` to write a head that does not fit). EAGLE-3: `draft_vocab` lists the
    target ids of its vocabulary (default: every token), `aux_layer_ids` goes to
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (None: left out, vLLM's defaults apply);
    `layout` "yuhuili" names the layer ``midlayer.``, "speculators" ``layers.0.``. `with_embed`:
    the head carries its own ``embed_tokens`` (else it shares the target's).

    `successors` (EAGLE-1 only): a head distilled to a table, token -> the token the target most
    often emits after it (e.g. counted in its greedy outputs): ``fc`` passes the embedding on, the
    layer adds nothing, and the head's own embedding of a token is the target's LM-head row of
    its successor, so the target's head draws the successor (a token missing from the table gets
    a random row). It predicts a target that mostly follows its last token."""
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target) / "config.json").read_text())
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act")
    cfg: dict[str, Any] = {k: tcfg[k] for k in keys if tcfg.get(k) is not None}
    cfg.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, torch_dtype="float32")
    cfg.update(config_overrides)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    target_h = cfg.get("target_hidden_size") or tcfg["hidden_size"]
    eagle3 = method == "eagle3"
    prefix = "midlayer." if eagle3 and layout == "yuhuili" else "layers.0."
    tensors = {prefix + k: v for k, v in _layer(cfg, 2 * h if eagle3 else h, gen, std, eagle3).items()}
    if eagle3:
        ids = torch.tensor(draft_vocab if draft_vocab is not None else list(range(vocab)), dtype=torch.int64)
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(ids))
        if aux_layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors.update({"fc.weight": std * torch.randn(h, 3 * target_h, generator=gen) / 1.7,
                        "norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                        "lm_head.weight": torch.randn(len(ids), h, generator=gen) * std,
                        "d2t": ids - torch.arange(len(ids)), "t2d": t2d})
    else:
        cfg.update(architectures=["LlamaForCausalLM"], bias=True)
        tensors.update({"fc.weight": std * torch.randn(h, 2 * h, generator=gen), "fc.bias": 0.1 * torch.randn(h, generator=gen)})
    if with_embed or successors:
        tensors["embed_tokens.weight"] = torch.randn(vocab, h, generator=gen)
    if successors:
        if eagle3:
            raise ValueError("successors: an EAGLE-1 head only")
        head = _target_lm_head(Path(target), tcfg)
        for x, nxt in successors.items():
            tensors["embed_tokens.weight"][x] = 8.0 * head[nxt] / head[nxt].norm()
        tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
        tensors["fc.bias"].zero_()
        tensors[prefix + "self_attn.o_proj.weight"].zero_()
        tensors[prefix + "mlp.down_proj.weight"].zero_()
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if eagle3:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(tensors, path / "pytorch_model.bin")
    return path


def _target_lm_head(target: Path, cfg: dict[str, Any]) -> torch.Tensor:
    from portside.model.loader import iterate_safetensors

    want = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    for name, tensor in iterate_safetensors(target):
        if name == want:
            return tensor.float()
    raise ValueError(f"{target}: no {want}")


def add_mtp_layer(model: str | os.PathLike, *, seed: int = 0, noise: float = 0.05) -> Path:
    """Give the DeepSeek-V3-style folder `model` (written with ``num_nextn_predict_layers=1`` and
    its last layer of the MTP layer's kind: experts from ``first_k_dense_replace`` on) the MTP
    layer its checkpoint names ``model.layers.{num_hidden_layers}.*``: the last layer's tensors
    plus `noise`, ``enorm``, ``hnorm``, ``eh_proj`` (2 x hidden -> hidden), ``shared_head.norm``
    and the copies ``embed_tokens`` / ``shared_head.head`` of the target's, as DeepSeek ships them."""
    from safetensors.torch import load_file, save_file

    model = Path(model)
    cfg = json.loads((model / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    if int(cfg.get("num_nextn_predict_layers") or 0) != 1:
        raise ValueError(f"{model}: write it with num_nextn_predict_layers=1")
    f = model / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    extra = {mtp + k.removeprefix(last): v + noise * torch.randn(v.shape, generator=gen).to(v.dtype)
             if v.is_floating_point() else v for k, v in tensors.items() if k.startswith(last)}
    extra.update({mtp + "enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                  mtp + "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                  mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5,
                  mtp + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                  mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                  mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file({**tensors, **{k: v.contiguous() for k, v in extra.items()}}, str(f), metadata={"format": "pt"})
    return model
