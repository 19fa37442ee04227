"""Pooling models offline: sentence-transformers folders over tiny decoders embed as
sentence-transformers itself does (pooling modes, Dense layers, prompts, Matryoshka dimensions),
decoder classifiers and cross-encoders score as transformers does, the Qwen3-Reranker conversion
(the LM head's yes/no logits) scores as its recipe computes, and a method of another task is
refused naming the one to use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM
from portside.pooling.params import PoolingParams
from portside.testing.tiny import make_tiny_model
from portside.testing.tiny_pooling import make_tiny_classifier, make_tiny_st_folder

TEXTS = ["the harbour town woke early", "a ship arrived from the south in the afternoon and her captain asked",
         "snow", "What is the capital of France? The capital of France is Paris."]
QUERY = "Instruct: find the passage\nQuery: "


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    return {
        "qwen3-last-dense": make_tiny_st_folder(root / "a", arch="qwen3", pooling_mode="lasttoken", dense=(48,),
                                                prompts={"query": QUERY, "document": ""}),
        "llama-mean": make_tiny_st_folder(root / "b", arch="llama", pooling_mode="mean", normalize=False),
        "qwen2-max-2dense": make_tiny_st_folder(root / "c", arch="qwen2", pooling_mode="max", dense=(40, 24),
                                                dense_activation="GELU"),
        "qwen3-cls": make_tiny_st_folder(root / "d", arch="qwen3", pooling_mode="cls", seed=3),
    }


def st_encode(path: Path, texts: list[str], **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts, **kwargs))


def assert_cosine(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double())
    assert bool((cos >= 0.99999).all()), f"cosine to sentence-transformers: {cos.tolist()}"


@pytest.mark.parametrize("name", ["qwen3-last-dense", "llama-mean", "qwen2-max-2dense", "qwen3-cls"])
def test_embeddings_equal_sentence_transformers(folders: dict[str, Path], name: str) -> None:
    """Every prompt in one batch; a 6-token budget splits the longer prompts over several steps."""
    path = folders[name]
    want = st_encode(path, TEXTS)
    with LLM(model=str(path), device="cpu", max_model_len=64, max_num_batched_tokens=6) as llm:
        assert llm.engine.config.model.pooling_task == "embed"  # runner auto: a bare decoder is a pooling model
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert_cosine(got, want)
    if name == "qwen3-last-dense":
        assert got.shape[1] == 48


def test_default_prompt(tmp_path: Path) -> None:
    """A folder's default_prompt_name applies to every text, as sentence-transformers' encode;
    prompt_name does not apply to token ids."""
    path = make_tiny_st_folder(tmp_path / "st", arch="llama", pooling_mode="mean", prompts={"query": QUERY},
                               default_prompt_name="query")
    with LLM(model=str(path), device="cpu", max_model_len=64) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
        assert outs[0].prompt_token_ids == llm.get_tokenizer()(QUERY + TEXTS[0]).input_ids
        assert_cosine(torch.tensor([o.outputs.embedding for o in outs]), st_encode(path, TEXTS))
        with pytest.raises(ValueError, match="prompt_name: applies to text prompts"):
            llm.embed([[5, 6, 7]], prompt_name="query", use_tqdm=False)


def test_prompts_and_dimensions(folders: dict[str, Path]) -> None:
    path = folders["qwen3-last-dense"]
    with LLM(model=str(path), device="cpu", max_model_len=64) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, prompt_name="query", use_tqdm=False)])
        assert_cosine(got, st_encode(path, TEXTS, prompt_name="query"))
        small = llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
        vec = torch.tensor([o.outputs.embedding for o in small])
        assert_cosine(vec, st_encode(path, TEXTS, truncate_dim=16))
        assert torch.allclose(vec.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)  # normalised again
        with pytest.raises(ValueError, match="dimensions: 49 is more than this model's embedding size 48"):
            llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=49), use_tqdm=False)
        with pytest.raises(ValueError, match="prompt_name: 'passage' is not one of this model's prompts"):
            llm.embed(TEXTS, prompt_name="passage", use_tqdm=False)
        # an embedding model scores by cosine (sentence-transformers' similarity for this folder)
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(path), device="cpu")
        want = st.similarity(st.encode(TEXTS[:1]), st.encode(TEXTS[1:]))[0]
        got_scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
        assert got_scores == pytest.approx(want.tolist(), abs=1e-5)
        with pytest.raises(ValueError, match="pooling task is 'embed'; use LLM.embed"):
            llm.classify(TEXTS, use_tqdm=False)


@torch.no_grad()
def hf_classifier_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sequence_classifier_equals_transformers(tmp_path: Path, arch: str) -> None:
    path = make_tiny_classifier(tmp_path / arch, arch, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    with LLM(model=str(path), device="cpu", max_model_len=64, max_num_batched_tokens=8) as llm:
        pooler = llm.engine.config.model.pooler
        assert pooler.task == "classify" and pooler.activation == "softmax" and pooler.labels == ("neg", "neu", "pos")
        outs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits_out in zip(outs, raw):
        logits = hf_classifier_logits(path, out.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(logits_out.outputs.probs), logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), logits.softmax(-1), atol=1e-4, rtol=0)
        assert out.outputs.num_classes == 3


def test_cross_encoder_score_and_reward(tmp_path: Path) -> None:
    """A one-label classifier scores (query, document) pairs tokenized as a text pair, through
    sigmoid; served with task reward, the same model returns the raw logit."""
    path = make_tiny_classifier(tmp_path / "ce", "qwen3", num_labels=1)
    query, docs = "where is the workshop", ["behind the church", "the market was full", "ask for Thomas"]
    with LLM(model=str(path), device="cpu", max_model_len=64) as llm:
        tok = llm.get_tokenizer()
        scores = llm.score(query, docs, use_tqdm=False)
        for doc, out in zip(docs, scores):
            ids = tok(query, doc).input_ids
            assert out.prompt_token_ids == ids
            assert out.outputs.score == pytest.approx(hf_classifier_logits(path, ids).sigmoid().item(), abs=1e-4)
        with pytest.raises(ValueError, match="data_2: is empty"):
            llm.score(query, [], use_tqdm=False)
        with pytest.raises(ValueError, match="pooling task is 'classify'"):
            llm.embed(docs, use_tqdm=False)
    with LLM(model=str(path), device="cpu", max_model_len=64, task="reward") as llm:
        (out,) = llm.reward([docs[0]], use_tqdm=False)
        want = hf_classifier_logits(path, out.prompt_token_ids)
        assert out.outputs.data == pytest.approx(want.tolist(), abs=1e-4)


@torch.no_grad()
def test_qwen3_reranker_conversion(tmp_path: Path) -> None:
    """vLLM's Qwen3-Reranker recipe: a Qwen3ForCausalLM scored by its LM head's logits of two
    tokens, sigmoid(logit(yes) - logit(no)) at the pair's last token (= the softmax over the two,
    the model card's formula)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(tmp_path / "rr", "qwen3")
    no, yes = AutoTokenizer.from_pretrained(str(path)).convert_ids_to_tokens([200, 201])  # stand-ins for "no", "yes"
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    query, docs = "<Query>: who mends masts", ["<Document>: Thomas the carpenter", "<Document>: fresh bread"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with LLM(model=str(path), device="cpu", max_model_len=64, runner="pooling", hf_overrides=overrides) as llm:
        tok = llm.get_tokenizer()
        no_id, yes_id = tok.convert_tokens_to_ids(no), tok.convert_tokens_to_ids(yes)
        assert llm.engine.config.model.pooler.from_token_ids == (no_id, yes_id)
        for doc, out in zip(docs, llm.score(query, docs, use_tqdm=False)):
            assert out.prompt_token_ids == tok(query, doc).input_ids  # the pair tokenized together
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
            want = logits[[no_id, yes_id]].softmax(-1)[1].item()
            assert out.outputs.score == pytest.approx(want, abs=1e-4)


def test_runner_and_task_resolution(tmp_path: Path, folders: dict[str, Path]) -> None:
    causal = make_tiny_model(tmp_path / "lm", "qwen3")
    with pytest.raises(ValueError, match="has no classifier: task classify needs"):
        LLM(model=str(causal), device="cpu", convert="classify")
    with pytest.raises(ValueError, match="is a pooling model"):
        LLM(model=str(folders["qwen3-cls"]), device="cpu", task="generate")
    with pytest.raises(ValueError, match="pooler_config: unknown key"):
        LLM(model=str(causal), device="cpu", runner="pooling", pooler_config={"pooling": "mean"})
    with LLM(model=str(causal), device="cpu", max_model_len=32, convert="embed", pooler_config='{"pooling_type": "mean"}') as llm:
        assert llm.engine.config.model.pooler.pooling_type == "mean"
        with pytest.raises(ValueError, match="LLM.classify does not apply"):
            llm.classify(["hello"], use_tqdm=False)
    with LLM(model=str(causal), device="cpu", max_model_len=32) as llm:  # runner auto: a causal LM generates
        assert llm.engine.config.model.pooler is None
        with pytest.raises(ValueError, match="needs a pooling model"):
            llm.score("a", "b")


def test_cli_flags(tmp_path: Path, folders: dict[str, Path]) -> None:
    """vLLM's flags resolve to the PoolerConfig the engine runs (no engine started)."""
    import argparse

    from portside.engine.args import EngineArgs
    from portside.engine.args_cli import add_engine_args, engine_kwargs
    from portside.platform import resolve_platform

    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def pooler(model: Path, *flags: str):  # type: ignore[no-untyped-def]
        args = EngineArgs(model=str(model), **engine_kwargs(parser.parse_args(list(flags))))
        return args.create_engine_config(resolve_platform("cpu")).model.pooler

    causal = make_tiny_model(tmp_path / "lm", "qwen3")
    assert pooler(causal) is None  # --runner auto: a causal LM generates
    p = pooler(causal, "--runner", "pooling", "--convert", "embed", "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}')
    assert (p.task, p.pooling_type, p.normalize) == ("embed", "mean", False)
    p = pooler(causal, "--runner", "pooling", "--hf-overrides", '{"classifier_from_token": ["<|im_start|>", "<|im_end|>"]}')
    assert (p.task, p.num_labels, p.activation, p.from_token_ids) == ("classify", 1, "sigmoid", (1, 2))
    p = pooler(folders["qwen2-max-2dense"])  # the folder's own pooling, its two Dense layers
    assert (p.pooling_type, len(p.dense), p.output_size) == ("max", 2, 24)
    assert pooler(folders["qwen2-max-2dense"], "--pooling-type", "cls").pooling_type == "cls"  # the flag wins
    with pytest.raises(ValueError, match="hf_overrides: unknown key"):
        pooler(causal, "--hf-overrides", '{"rope_theta": 1}')
    with pytest.raises(ValueError, match="disagree"):
        pooler(causal, "--runner", "embed", "--convert", "classify")
