"""A Qwen3-Next MTP layer for a tiny random-weight Qwen3-Next folder (`make_tiny_hybrid`), written
into its checkpoint in the published layout (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*`` as a full-attention decoder layer of layer 0's MLP
kind, ``mtp.norm``), as `portside.spec_decode.qwen3_next_mtp` reads it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["add_qwen3_next_mtp", "mtp_twin"]


def add_qwen3_next_mtp(model: str | os.PathLike, *, seed: int = 0, noise: float = 0.05,
                       successors: dict[int, int] | None = None) -> Path:
    """Give the Qwen3-Next folder `model` an MTP layer: its attention tensors those of the model's
    first full-attention layer, its norms and MLP (or experts) layer 0's, each plus `noise`; ``fc``
    random. `successors` (token -> the token the target emits after it, at most hidden_size - 1
    of them): a layer distilled to that table instead, so its proposals are the successors of
    the table's tokens (and arbitrary for the others): ``fc`` maps each token's normed embedding
    to the LM-head row of its successor (a least-squares solve), its hidden half and the layer's
    output projections are zero, so the layer passes ``fc``'s output on to the target's LM head."""
    from safetensors.torch import load_file, save_file

    model = Path(model)
    cfg = json.loads((model / "config.json").read_text())
    h, types = cfg["hidden_size"], cfg["layer_types"]
    f = model / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(seed)
    attn = f"model.layers.{types.index('full_attention')}."

    def jitter(t: torch.Tensor) -> torch.Tensor:
        return t + noise * torch.randn(t.shape, generator=gen).to(t.dtype)

    extra = {"mtp.layers.0." + k.removeprefix(attn): jitter(v) for k, v in tensors.items()
             if k.startswith(attn + "self_attn.")}
    extra.update({"mtp.layers.0." + k.removeprefix("model.layers.0."): jitter(v) for k, v in tensors.items()
                  if k.startswith(("model.layers.0.mlp.", "model.layers.0.input_layernorm.",
                                   "model.layers.0.post_attention_layernorm."))})
    extra.update({f"mtp.{n}.weight": 0.1 * torch.randn(h, generator=gen)  # zero-centred norms
                  for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    extra["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    if successors:
        if len(successors) >= h:
            raise ValueError(f"successors: at most {h - 1} tokens (hidden_size {h})")
        emb, head = tensors["model.embed_tokens.weight"].float(), tensors["lm_head.weight"].float()
        keys = list(successors)
        e = emb[keys] * torch.rsqrt(emb[keys].pow(2).mean(-1, keepdim=True) + cfg.get("rms_norm_eps", 1e-6))
        rows = head[[successors[k] for k in keys]]
        goal = 8.0 * rows / rows.norm(dim=-1, keepdim=True)
        m = torch.linalg.lstsq(e, goal).solution.t()  # e @ m.T = goal
        extra["mtp.fc.weight"] = torch.cat([m, torch.zeros(h, h)], dim=1)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            extra[f"mtp.{n}.weight"].zero_()
        for k, v in extra.items():
            if k.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                v.zero_()
    save_file({**tensors, **{k: v.contiguous() for k, v in extra.items()}}, str(f), metadata={"format": "pt"})
    return model


def mtp_twin(model: str | os.PathLike, path: str | os.PathLike) -> Path:
    """A one-layer Qwen3-Next folder at `path` whose decoder layer is `model`'s MTP layer (its
    ``mtp.layers.0.*``), final norm ``mtp.norm`` and embedding and LM head the target's: run by
    transformers on ``inputs_embeds`` = ``mtp.fc``'s output, it is an independent reference of
    the MTP layer (the layer's attention over the positions given, no cache)."""
    from safetensors.torch import load_file, save_file

    model, path = Path(model), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"],
               mlp_only_layers=[0] if 0 in (cfg.get("mlp_only_layers") or []) else [])
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(str(model / "model.safetensors"))
    twin = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"], "lm_head.weight": tensors["lm_head.weight"],
            "model.norm.weight": tensors["mtp.norm.weight"]}
    twin.update({"model.layers.0." + k.removeprefix("mtp.layers.0."): v for k, v in tensors.items()
                 if k.startswith("mtp.layers.0.")})
    save_file({k: v.contiguous() for k, v in twin.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
