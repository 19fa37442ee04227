"""Encoder-only models against sentence-transformers itself: a sentence-transformers folder over
the tiny BERT / XLM-R / ModernBERT (its Pooling, a Dense layer, Normalize), served with no task
named, gives `LLM.embed` vectors equal to `SentenceTransformer.encode` (cosine >= 0.99999, fp32);
a BERT cross-encoder's `LLM.score` equals `CrossEncoder.predict` to 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM
from portside.testing.tiny_encoder import make_tiny_encoder
from portside.testing.tiny_pooling import make_tiny_st_folder

pytest.importorskip("sentence_transformers")

TEXTS = ["the quick brown fox jumps over the lazy dog", "a small cat sleeps", "hi",
         "the harbour town woke early and the bakers lit their ovens while boats slipped out"]


@pytest.mark.parametrize(("arch", "pooling", "dense"), [("bert", "mean", ()), ("bert", "cls", (32,)),
                                                        ("xlm-roberta", "cls", ()), ("modernbert", "mean", (48,))])
def test_embed_equals_sentence_transformers(tmp_path: Path, arch: str, pooling: str, dense: tuple[int, ...]) -> None:
    from sentence_transformers import SentenceTransformer

    base = make_tiny_encoder(tmp_path / f"{arch}-base", arch, seed=21)
    folder = make_tiny_st_folder(tmp_path / arch, base, pooling_mode=pooling, dense=dense, seed=21)
    want = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=8)).float()
    with LLM(model=str(folder), device="cpu") as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        assert llm.engine.stats().num_used_blocks == 0
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert cos.min().item() >= 0.99999, cos


def test_score_equals_cross_encoder(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    path = make_tiny_encoder(tmp_path / "ce", "bert", classifier=True, num_labels=1, seed=22)
    query = "the quick brown fox"
    want = CrossEncoder(str(path), device="cpu").predict([(query, d) for d in TEXTS])
    with LLM(model=str(path), device="cpu") as llm:
        got = [o.outputs.score for o in llm.score(query, TEXTS, use_tqdm=False)]
    assert got == pytest.approx([float(w) for w in want], abs=1e-4)
