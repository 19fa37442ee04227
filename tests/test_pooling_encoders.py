"""Encoder pooling models end to end through `LLM`: sentence-transformers folders over BERT,
XLM-RoBERTa and ModernBERT (their own pooling modes, one with a Dense layer) embed as
sentence-transformers does, and their cross-encoders score (query, document) pairs, tokenized as
text pairs with BERT's token types, as transformers does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM
from portside.testing.tiny_encoder import make_tiny_encoder
from portside.testing.tiny_pooling import make_tiny_st_folder

TEXTS = ["the harbour town woke early", "a ship arrived from the south in the afternoon and her captain asked",
         "snow", "What is the capital of France? The capital of France is Paris."]


@pytest.mark.parametrize(("arch", "mode", "dense"), [("bert", "mean", (32,)), ("xlm-roberta", "cls", ()),
                                                     ("modernbert", "mean", ()), ("bert", "max", ())])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path: Path, arch: str, mode: str, dense: tuple[int, ...]) -> None:
    from sentence_transformers import SentenceTransformer

    base = make_tiny_encoder(tmp_path / "base", arch)
    path = make_tiny_st_folder(tmp_path / "st", base, pooling_mode=mode, dense=dense)
    want = torch.tensor(SentenceTransformer(str(path), device="cpu").encode(TEXTS))
    with LLM(model=str(path), device="cpu", max_model_len=64) as llm:  # runner auto: an encoder pools
        assert llm.engine.config.model.pooler.pooling_type == {"mean": "mean", "cls": "cls", "max": "max"}[mode]
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double())
    assert bool((cos >= 0.99999).all()), cos.tolist()


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert"])
@torch.no_grad()
def test_encoder_cross_encoder_scores_equal_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_encoder(tmp_path / arch, arch, classifier=True, num_labels=1)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    query = "who mends the masts"
    with LLM(model=str(path), device="cpu", max_model_len=64) as llm:
        assert llm.engine.config.model.pooler.task == "classify"
        outs = llm.score(query, TEXTS, use_tqdm=False)
    for doc, out in zip(TEXTS, outs):
        enc = tok(query, doc, return_tensors="pt")
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        want = hf(**enc).logits[0, 0].sigmoid().item()
        assert out.outputs.score == pytest.approx(want, abs=1e-4)


@torch.no_grad()
def test_encoder_classifier_probs_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_encoder(tmp_path / "cls", "bert", classifier=True, num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with LLM(model=str(path), device="cpu", max_model_len=64) as llm:
        outs = llm.classify(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        want = hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=0)
