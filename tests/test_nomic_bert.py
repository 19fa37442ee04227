"""NomicBERT (nomic-embed-text): transformers has no class for it, so the oracle is a torch
transcription of nomic's published forward (contrastors' NomicBertModel, non-prenorm, rotary
non-interleaved), written here independently of portside's model, over the same checkpoint
tensors: per-prompt attention with an explicit softmax, rotary by rotate-half on [H, L, D]."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from portside import LLM
from portside.backends.cpu.attention import CpuAttentionBackend
from portside.testing.tiny_encoder import encoder_step_context, load_encoder, make_tiny_nomic


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


@torch.no_grad()
def nomic_reference(path: Path, ids: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
    """[L, H] final hidden states of one prompt."""
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    h, heads = cfg["n_embd"], cfg["n_head"]
    d = h // heads
    rot = int(d * cfg["rotary_emb_fraction"])
    act = {"swiglu": F.silu, "geglu": F.gelu}[cfg["activation_function"]]
    ln = lambda x, n: F.layer_norm(x, (h,), w[n + ".weight"], w[n + ".bias"], cfg["layer_norm_epsilon"])  # noqa: E731
    types = torch.zeros_like(ids) if types is None else types
    x = ln(w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][types], "emb_ln")
    n = len(ids)
    inv = 1.0 / (cfg["rotary_emb_base"] ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(n).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [L, rot]
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        q, k, v = (x @ w[p + "attn.Wqkv.weight"].T).view(n, 3, heads, d).permute(1, 2, 0, 3)  # [H, L, D] each

        def rope(t: torch.Tensor) -> torch.Tensor:
            r, rest = t[..., :rot], t[..., rot:]
            return torch.cat([r * cos + _rotate_half(r) * sin, rest], dim=-1)

        scores = rope(q) @ rope(k).transpose(-1, -2) / d**0.5
        o = (scores.softmax(-1) @ v).permute(1, 0, 2).reshape(n, h)
        x = ln(x + o @ w[p + "attn.out_proj.weight"].T, p + "norm1")
        m = (x @ w[p + "mlp.fc11.weight"].T) * act(x @ w[p + "mlp.fc12.weight"].T)
        x = ln(x + m @ w[p + "mlp.fc2.weight"].T, p + "norm2")
    return x


@pytest.mark.parametrize(("fraction", "act"), [(1.0, "swiglu"), (0.5, "geglu")])
def test_nomic_matches_the_reference_batched_and_alone(tmp_path: Path, fraction: float, act: str) -> None:
    path = make_tiny_nomic(tmp_path / "nomic", seed=4, rotary_emb_fraction=fraction, activation_function=act)
    model = load_encoder(path)
    assert model.default_pooling_type == "mean"
    lengths = [6, 19, 1, 11]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=g) for n in lengths]
    types = [torch.tensor([0] * (n // 2) + [1] * (n - n // 2)) for n in lengths]
    ctx, pos = encoder_step_context(CpuAttentionBackend(), lengths, [t.tolist() for t in types])
    with torch.no_grad():
        packed = model(torch.cat(prompts), pos, ctx)
    start = 0
    for ids, t in zip(prompts, types):
        want = nomic_reference(path, ids, t)
        torch.testing.assert_close(packed[start : start + len(ids)], want, atol=1e-5, rtol=1e-4)
        alone_ctx, alone_pos = encoder_step_context(CpuAttentionBackend(), [len(ids)])
        with torch.no_grad():
            alone = model(ids, alone_pos, alone_ctx)
        torch.testing.assert_close(alone, nomic_reference(path, ids), atol=1e-5, rtol=1e-4)
        start += len(ids)


def test_nomic_through_the_engine(tmp_path: Path) -> None:
    path = make_tiny_nomic(tmp_path / "nomic", seed=9)
    texts = ["search_query: the quick brown fox", "search_document: a small cat sleeps in the warm sun", "hi"]
    with LLM(model=str(path), device="cpu", task="embed", pooling_type="mean", max_model_len=128) as llm:
        outs = llm.embed(texts, use_tqdm=False)
        for out in outs:
            ids = torch.tensor(out.prompt_token_ids)
            want = F.normalize(nomic_reference(path, ids).mean(0), dim=0)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=2e-5, rtol=1e-4)
        assert llm.engine.stats().num_used_blocks == 0


def test_nomic_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    path = make_tiny_nomic(tmp_path / "nomic")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"rotary_emb_interleaved": True}))
    with pytest.raises(ValueError, match="rotary_emb_interleaved=True is not supported"):
        load_encoder(path)
