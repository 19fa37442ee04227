"""Encoder-only models through the engine (`LLM(task="embed")`): several prompts of different
lengths batched in one step, each computed whole; the pooled vectors equal transformers' final
hidden states pooled and L2-normalised; BERT token types from the prompt dict; no KV block in
use afterwards; and the errors for what an encoder cannot do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM
from portside.testing.tiny_encoder import make_tiny_encoder

TEXTS = ["the quick brown fox", "a small cat sleeps in the warm sun and the river runs to the sea under a bright sky",
         "hi", "the harbour town woke early and the bakers lit their ovens"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_encoder(tmp_path_factory.mktemp("bert"), "bert", seed=7)


@torch.no_grad()
def _hf_vector(path: Path, ids: list[int], pooling: str, types: list[int] | None = None) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModel.from_pretrained(path).eval()
    kw = {} if types is None else {"token_type_ids": torch.tensor([types])}
    hidden = hf(torch.tensor([ids]), **kw).last_hidden_state[0]
    vec = hidden[0] if pooling == "cls" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=0)


def _assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} KV blocks still in use"
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize(("arch", "pooling"), [("bert", "cls"), ("bert", "mean"), ("xlm-roberta", "cls"),
                                               ("modernbert", "mean")])
def test_embed_matches_transformers(tmp_path: Path, arch: str, pooling: str) -> None:
    path = make_tiny_encoder(tmp_path / arch, arch, seed=11)
    with LLM(model=str(path), device="cpu", task="embed", pooling_type=pooling, block_size=4) as llm:
        steps = []
        original = llm.engine.executor.execute_model

        def counting(so):  # type: ignore[no-untyped-def]
            if so.num_scheduled_tokens:
                steps.append(dict(so.num_scheduled_tokens))
            return original(so)

        llm.engine.executor.execute_model = counting  # type: ignore[method-assign]
        outs = llm.embed(TEXTS, use_tqdm=False)
        tok = llm.get_tokenizer()
        for text, out in zip(TEXTS, outs):
            ids = tok(text)["input_ids"]
            assert out.prompt_token_ids == ids
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), _hf_vector(path, ids, pooling),
                                       atol=2e-5, rtol=1e-4)
        # one forward for the four prompts, each whole
        assert len(steps) == 1 and sorted(steps[0].values()) == sorted(len(tok(t)["input_ids"]) for t in TEXTS)
        assert not llm.engine.config.cache.enable_prefix_caching
        assert not llm.engine.config.scheduler.enable_chunked_prefill
        _assert_idle(llm)


def test_token_type_ids_from_the_prompt(bert: Path) -> None:
    with LLM(model=str(bert), device="cpu", task="embed", pooling_type="cls") as llm:
        tok = llm.get_tokenizer()
        enc = tok("the quick brown fox", "a small cat sleeps")
        ids, types = enc["input_ids"], enc["token_type_ids"]
        assert 1 in types  # the pair's second text
        outs = llm.embed([{"prompt_token_ids": ids, "token_type_ids": types}, {"prompt_token_ids": ids}],
                         use_tqdm=False)
        torch.testing.assert_close(torch.tensor(outs[0].outputs.embedding), _hf_vector(bert, ids, "cls", types),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(outs[1].outputs.embedding), _hf_vector(bert, ids, "cls"),
                                   atol=2e-5, rtol=1e-4)
        with pytest.raises(ValueError, match="token_type_ids has 2 entries for a prompt of"):
            llm.embed([{"prompt_token_ids": ids, "token_type_ids": [0, 1]}], use_tqdm=False)
        with pytest.raises(ValueError, match="token_type_ids: 2 is out of range; this model has 2 token types"):
            llm.embed([{"prompt_token_ids": ids, "token_type_ids": [2] * len(ids)}], use_tqdm=False)
        with pytest.raises(ValueError, match="too long|max_model_len|must have 1 to 128"):
            llm.embed([{"prompt_token_ids": [5] * 129}], use_tqdm=False)
        _assert_idle(llm)


def test_token_type_ids_refused_by_a_decoder(tiny_llama: Path) -> None:
    with LLM(model=str(tiny_llama), device="cpu", max_model_len=64, task="embed") as llm:
        with pytest.raises(ValueError, match="this model takes no token types"):
            llm.embed([{"prompt_token_ids": [5, 6, 7], "token_type_ids": [0, 0, 1]}], use_tqdm=False)


def test_encoder_limits(tmp_path: Path, bert: Path) -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens 64 is below max_model_len 128: BertModel"):
        LLM(model=str(bert), device="cpu", task="embed", max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="has 128 positions; pass at most 128"):
        LLM(model=str(bert), device="cpu", task="embed", max_model_len=200)
    for kwargs, message in [({"tensor_parallel_size": 2}, "does not run with tensor_parallel_size 2"),
                            ({"pipeline_parallel_size": 2}, "does not run with pipeline_parallel_size 2"),
                            ({"enable_lora": True}, "does not run with LoRA adapters"),
                            ({"kv_cache_dtype": "fp8_e4m3"}, "does not run with --kv-cache-dtype fp8_e4m3")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=str(bert), device="cpu", task="embed", **kwargs)
    xlmr = make_tiny_encoder(tmp_path / "xlmr", "xlm-roberta")
    with LLM(model=str(xlmr), device="cpu", task="embed") as llm:  # 130 positions, the first at padding_idx 0 + 1
        assert llm.engine.max_model_len == 129
        out = llm.embed([{"prompt_token_ids": [5] * 129}], use_tqdm=False)  # the last position is 129 + 0
        assert len(out[0].outputs.embedding) == 64


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert"])
def test_cross_encoder_scores_match_transformers(tmp_path: Path, arch: str) -> None:
    """A *ForSequenceClassification folder served with no task named: a pooling model; `LLM.score`
    of (query, document) pairs equals transformers' sigmoid(logit) on the tokenizer's pair (BERT:
    with its token types)."""
    import transformers

    path = make_tiny_encoder(tmp_path / arch, arch, classifier=True, num_labels=1, seed=13)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    docs = ["a small cat sleeps in the warm sun", "the river runs", "the harbour town woke early"]
    with LLM(model=str(path), device="cpu") as llm:
        tok = llm.get_tokenizer()
        outs = llm.score("the quick brown fox", docs, use_tqdm=False)
        for doc, out in zip(docs, outs):
            enc = tok("the quick brown fox", doc, return_tensors="pt")
            with torch.no_grad():
                want = torch.sigmoid(hf(**enc).logits)[0, 0].item()
            assert out.outputs.score == pytest.approx(want, abs=1e-5)
        _assert_idle(llm)
    with pytest.raises(ValueError, match="pooling model"):
        LLM(model=str(path), device="cpu", task="generate")


def test_devices_report_says_no_kv_cache(bert: Path) -> None:
    """`portside devices --model` for an encoder: no KV line, no sequence count, no division by zero."""
    from portside.engine.kv_report import cache_report

    report = cache_report(bert, torch.float32)
    assert report.bytes_per_token == 0 and report.sequences(2**30, 512) is None
    text = report.format(2**30, 512)
    assert text.startswith("BertModel: 2 layers") and "no KV cache" in text
