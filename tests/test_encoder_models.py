"""Encoder-only models (BERT, XLM-RoBERTa, ModernBERT and their sequence-classification heads):
portside's final hidden states and classifier logits equal transformers' on the same tiny
random-weight folder (fp32), for prompts alone and packed in one step with different lengths,
with BERT token types, through core's reference and the cpu backend's encoder attention; and
bidirectional attention's reference (windowed too) against an independent masked softmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside.attention.reference import ReferenceAttentionBackend, encoder_attention
from portside.backends.cpu.attention import CpuAttentionBackend
from portside.testing.tiny_encoder import encoder_step_context, load_encoder, make_tiny_encoder

LENGTHS = [5, 17, 1, 12]  # ModernBERT's local window is 4 either side: the longer prompts use it
BACKENDS = {"reference": ReferenceAttentionBackend, "cpu": CpuAttentionBackend}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, bool], Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("encoders")
    return {(arch, clf): make_tiny_encoder(root / f"{arch}-{clf}", arch, classifier=clf, seed=3)
            for arch in ("bert", "xlm-roberta", "modernbert") for clf in (False, True)}


def _hf(path: Path):  # type: ignore[no-untyped-def]
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, cfg.architectures[0]).from_pretrained(path).eval()


def _prompts(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=g) for n in lengths]


def _segments(n: int) -> torch.Tensor:
    """A text pair's token types: the first half 0, the rest 1."""
    return torch.cat([torch.zeros(n // 2, dtype=torch.long), torch.ones(n - n // 2, dtype=torch.long)])


@torch.no_grad()
def _hf_hidden(hf, ids: torch.Tensor, types: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[no-untyped-def]
    """transformers' last hidden state [n, H] (after ModernBERT's final norm) and, for a
    classifier, its logits [1, num_labels]."""
    kw = {} if types is None else {"token_type_ids": types[None]}
    base = getattr(hf, "bert", None) or getattr(hf, "roberta", None) or getattr(hf, "model", None) or hf
    hidden = base(ids[None], **kw).last_hidden_state[0]
    logits = hf(ids[None], **kw).logits if base is not hf else None
    return hidden, logits


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("clf", [False, True], ids=["model", "classifier"])
@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert"])
def test_matches_transformers_batched_and_alone(folders, arch: str, clf: bool, backend: str) -> None:  # type: ignore[no-untyped-def]
    path = folders[(arch, clf)]
    model, hf = load_encoder(path), _hf(path)
    prompts = _prompts(LENGTHS)
    types = [_segments(len(p)) for p in prompts] if arch == "bert" else None
    ctx, positions = encoder_step_context(BACKENDS[backend](), LENGTHS, None if types is None else [t.tolist() for t in types])
    with torch.no_grad():
        packed = model(torch.cat(prompts), positions, ctx)
    assert packed.shape == (sum(LENGTHS), 64)
    start = 0
    for i, ids in enumerate(prompts):
        t = None if types is None else types[i]
        want, logits = _hf_hidden(hf, ids, t)
        rows = packed[start : start + len(ids)]
        torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"prompt {i} batched: {m}")
        alone_ctx, alone_pos = encoder_step_context(BACKENDS[backend](), [len(ids)], None if t is None else [t.tolist()])
        with torch.no_grad():
            alone = model(ids, alone_pos, alone_ctx)
        torch.testing.assert_close(alone, want, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"prompt {i} alone: {m}")
        if clf:
            assert model.num_labels == 3
            pooled = rows[0:1] if model.default_pooling_type == "cls" else rows.mean(0, keepdim=True)
            with torch.no_grad():
                got = model.classify(pooled)
            torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"prompt {i} logits: {m}")
        start += len(ids)


@pytest.mark.parametrize("clf", [False, True], ids=["model", "classifier"])
def test_xlm_roberta_positions_skip_padding_tokens(folders, clf: bool) -> None:  # type: ignore[no-untyped-def]
    """A prompt holding XLM-R's padding token: transformers numbers the positions of the tokens
    that are not padding only (the padding token sits at padding_idx); so does portside, per
    prompt of a packed step."""
    path = folders[("xlm-roberta", clf)]
    model, hf = load_encoder(path), _hf(path)
    pad = hf.config.pad_token_id
    prompts = _prompts([9, 6, 11], seed=4)
    prompts[0][3] = pad
    prompts[2][0] = pad
    prompts[2][7:9] = pad
    ctx, positions = encoder_step_context(CpuAttentionBackend(), [9, 6, 11])
    with torch.no_grad():
        packed = model(torch.cat(prompts), positions, ctx)
    start = 0
    for ids in prompts:
        want, _ = _hf_hidden(hf, ids, None)
        torch.testing.assert_close(packed[start : start + len(ids)], want, atol=1e-5, rtol=1e-4)
        start += len(ids)


def test_token_types_change_bert_states(folders) -> None:  # type: ignore[no-untyped-def]
    """Segment ids reach the embeddings (a pair's second text differs from the same ids as type 0)."""
    model = load_encoder(folders[("bert", False)])
    ids = _prompts([9])[0]
    with torch.no_grad():
        plain = model(ids, *reversed(encoder_step_context(CpuAttentionBackend(), [9])))
        pair = model(ids, *reversed(encoder_step_context(CpuAttentionBackend(), [9], [_segments(9).tolist()])))
    assert not torch.allclose(plain, pair)


def test_modernbert_mean_pooling_classifier(tmp_path: Path) -> None:
    path = make_tiny_encoder(tmp_path / "mb-mean", "modernbert", classifier=True, classifier_pooling="mean", seed=5)
    model, hf = load_encoder(path), _hf(path)
    assert model.default_pooling_type == "mean"
    ids = _prompts([14], seed=2)[0]
    ctx, pos = encoder_step_context(CpuAttentionBackend(), [14])
    with torch.no_grad():
        logits = model.classify(model(ids, pos, ctx).mean(0, keepdim=True))
    torch.testing.assert_close(logits, _hf_hidden(hf, ids, None)[1], atol=1e-5, rtol=1e-4)


def test_default_pooling_types(folders) -> None:  # type: ignore[no-untyped-def]
    for arch in ("bert", "xlm-roberta", "modernbert"):
        assert load_encoder(folders[(arch, False)]).default_pooling_type == "cls"


def test_encoder_models_generate_nothing_and_keep_no_cache(folders) -> None:  # type: ignore[no-untyped-def]
    model = load_encoder(folders[("bert", False)])
    assert model.kv_cache_spec().num_layers == 0 and model.kv_cache_spec().bytes_per_token == 0
    with pytest.raises(ValueError, match="encoder-only model: it pools"):
        model.compute_logits(torch.zeros(1, 64))


def test_a_chunked_prompt_is_refused(folders) -> None:  # type: ignore[no-untyped-def]
    """A step that continues a prompt computed earlier cannot be attended bidirectionally."""
    model = load_encoder(folders[("bert", False)])
    ctx, pos = encoder_step_context(CpuAttentionBackend(), [4])
    ctx.metadata.seq_lens_cpu = [9]  # 4 new tokens after 5 computed in an earlier step
    with pytest.raises(ValueError, match="whole in one step"):
        model(_prompts([4])[0], pos, ctx)


# ---- bidirectional attention: the reference and the cpu fast path -------------------------------


def _masked_softmax_attention(q, k, v, lengths, scale, window):  # type: ignore[no-untyped-def]
    """An independent formulation: one [T, T] mask over the packed tokens (same sequence, and
    within the window), one softmax."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = torch.arange(sum(lengths))
    allowed = seq[:, None] == seq[None, :]
    if window is not None:
        allowed &= (t[:, None] - t[None, :]).abs() <= window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window", [None, 0, 2, 6, 50])
@pytest.mark.parametrize("lengths", [(7, 1, 16, 16, 3), (1,), (30,)], ids=str)
def test_encoder_attention_window(lengths: tuple[int, ...], window: int | None) -> None:
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(sum(lengths), 3, 16, generator=g) for _ in range(3))
    cu = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    want = _masked_softmax_attention(q, k, v, list(lengths), 0.3, window)
    ref = encoder_attention(q, k, v, cu, max(lengths), 0.3, sliding_window=window)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    fast = CpuAttentionBackend().encoder_attention(q, k, v, cu, max(lengths), 0.3, sliding_window=window)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)
    half = CpuAttentionBackend().encoder_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, max(lengths), 0.3,
                                                   sliding_window=window)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, atol=2e-2, rtol=2e-2)


def test_context_routes_an_unlisted_feature_to_the_reference() -> None:
    """A backend whose `encoder_features` lack the window gets windowed layers run by core's reference."""

    class NoWindow(CpuAttentionBackend):
        encoder_features = frozenset()

        def encoder_attention(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            assert not kwargs, "a feature the backend does not list reached it"
            return super().encoder_attention(*args)

    lengths = [6, 11]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(17, 2, 8, generator=g) for _ in range(3))
    ctx, _ = encoder_step_context(NoWindow(), lengths)
    torch.testing.assert_close(ctx.encoder_attention(q, k, v, 0.5, sliding_window=2),
                               _masked_softmax_attention(q, k, v, lengths, 0.5, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ctx.encoder_attention(q, k, v, 0.5, sliding_window=None),
                               _masked_softmax_attention(q, k, v, lengths, 0.5, None), atol=1e-5, rtol=1e-5)


def test_bert_checkpoint_as_pretraining_exports_name_it(folders, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """bert-base-uncased's layout: every tensor under "bert.", LayerNorm gamma / beta, the
    pre-training heads ("cls.") beside them: loaded by name, the heads left out."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = folders[("bert", False)]
    dst = tmp_path / "bert-pretraining"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in tensors.items()}
    renamed["cls.predictions.bias"] = torch.zeros(8)
    renamed["bert.embeddings.position_ids"] = torch.arange(128)[None]
    save_file(renamed, str(dst / "model.safetensors"))
    a, b = load_encoder(src), load_encoder(dst)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    (dst / "model.safetensors").unlink()
    save_file({**renamed, "bert.encoder.layer.9.output.dense.weight": torch.zeros(2)}, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'bert.encoder.layer.9.output.dense.weight' has no place in BertModel"):
        load_encoder(dst)


def test_bert_query_key_value_load_into_one_fused_projection(folders, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint's query, key and value tensors fill the thirds of the fused qkv linear;
    without one of them the load is refused naming the fused tensor; a partial reload (weight
    updates) writes its third only."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = folders[("bert", False)]
    tensors = load_file(str(src / "model.safetensors"))
    model = load_encoder(src)
    qkv = model.encoder.layer[1].attention.self.qkv
    parts = [tensors[f"encoder.layer.1.attention.self.{n}.weight"] for n in ("query", "key", "value")]
    assert torch.equal(qkv.weight, torch.cat(parts))
    assert torch.equal(qkv.bias[-parts[2].shape[0]:], tensors["encoder.layer.1.attention.self.value.bias"])
    new_key = torch.randn_like(parts[1])
    model.load_weights([("encoder.layer.1.attention.self.key.weight", new_key)])
    assert torch.equal(qkv.weight, torch.cat([parts[0], new_key, parts[2]]))
    dst = tmp_path / "bert-no-key"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file({k: v for k, v in tensors.items() if k != "encoder.layer.0.attention.self.key.bias"},
              str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors.*encoder.layer.0.attention.self.qkv.bias"):
        load_encoder(dst)
