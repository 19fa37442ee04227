"""The pooling APIs on the real server: /v1/embeddings through the openai SDK equals
sentence-transformers (a tiny folder with a Dense layer), Matryoshka `dimensions`; /v2/rerank
through the official cohere SDK (ClientV2 with base_url) and a Jina-style /rerank through httpx,
ordered by score with the right indices, scores equal transformers' cross-encoder; /score,
/classify, /pooling; the 400s for bad input and for a task the server does not run."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import API_KEY
from helpers import post
from server_process import ServerProcess

from portside.testing.tiny_pooling import make_tiny_classifier, make_tiny_st_folder

QUERY = "who mends the masts of ships"
DOCS = ["Thomas the carpenter works behind the church", "the bakers lit their ovens", "a ship arrived from the south",
        "fresh bread drifted along the quay"]


def start(model: Path, log: Path) -> ServerProcess:
    return ServerProcess(model, log, "--max-model-len", "128", "--max-num-batched-tokens", "64", api_key=API_KEY).wait_ready()


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_st_folder(tmp_path_factory.mktemp("st") / "embed", arch="qwen3", pooling_mode="lasttoken", dense=(48,))


@pytest.fixture(scope="module")
def ce_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_classifier(tmp_path_factory.mktemp("ce") / "rerank", "qwen3", num_labels=1)


@pytest.fixture(scope="module")
def embed_server(st_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(st_folder, tmp_path_factory.mktemp("embed-log") / "server.log")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def ce_server(ce_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(ce_folder, tmp_path_factory.mktemp("ce-log") / "server.log")
    try:
        yield proc
    finally:
        proc.kill()


@torch.no_grad()
def hf_pair_logit(path: Path, query: str, doc: str) -> float:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    return float(model(torch.tensor([tok(query, doc).input_ids])).logits[0, 0])


def sigmoid(x: float) -> float:
    return float(1 / (1 + np.exp(-x)))


def assert_error(r: httpx.Response, param: str | None, says: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"], error
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.slow
def test_openai_embeddings_equal_sentence_transformers(embed_server: ServerProcess, st_folder: Path) -> None:
    import openai
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(st_folder), device="cpu").encode(DOCS)
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    res = client.embeddings.create(model="tiny", input=DOCS)  # base64 on the wire, as the SDK asks
    got = np.array([d.embedding for d in res.data])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert (cos >= 0.99999).all(), cos
    small = client.embeddings.create(model="tiny", input=DOCS[:2], dimensions=16, encoding_format="float")
    vec = np.array([d.embedding for d in small.data])
    assert vec.shape == (2, 16)
    np.testing.assert_allclose(vec, got[:2, :16] / np.linalg.norm(got[:2, :16], axis=1, keepdims=True), atol=1e-5)
    embed_server.wait_idle()


@pytest.mark.slow
def test_cohere_v2_rerank(ce_server: ServerProcess, ce_folder: Path) -> None:
    import cohere

    client = cohere.ClientV2(api_key=API_KEY, base_url=ce_server.url)
    res = client.rerank(model="tiny", query=QUERY, documents=DOCS, top_n=3)
    want = [sigmoid(hf_pair_logit(ce_folder, QUERY, d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [r.index for r in res.results] == order
    for r in res.results:
        assert r.relevance_score == pytest.approx(want[r.index], abs=1e-4)
    ce_server.wait_idle()


@pytest.mark.slow
def test_jina_rerank_score_classify_pooling(ce_server: ServerProcess, ce_folder: Path) -> None:
    logits = [hf_pair_logit(ce_folder, QUERY, d) for d in DOCS]
    for path in ("/rerank", "/v1/rerank"):
        r = post(ce_server, path, {"model": "tiny", "query": QUERY, "documents": DOCS, "return_documents": True})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        scores = [x["relevance_score"] for x in results]
        assert scores == sorted(scores, reverse=True)
        assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
        for x in results:
            assert x["document"]["text"] == DOCS[x["index"]]
            assert x["relevance_score"] == pytest.approx(sigmoid(logits[x["index"]]), abs=1e-4)
        assert r.json()["usage"]["total_tokens"] > 0
    one = post(ce_server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False}).json()
    assert len(one["results"]) == 1 and "document" not in one["results"][0]
    score = post(ce_server, "/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in score["data"]] == list(range(len(DOCS)))
    assert [d["score"] for d in score["data"]] == pytest.approx([sigmoid(x) for x in logits], abs=1e-4)
    classify = post(ce_server, "/classify", {"model": "tiny", "input": DOCS[:2]}).json()
    assert [d["num_classes"] for d in classify["data"]] == [1, 1] and classify["data"][0]["label"] == "LABEL_0"
    pooled = post(ce_server, "/pooling", {"input": DOCS[0], "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(pooled["data"][0]["data"]), dtype="<f4")
    assert raw.shape == (1,)  # the classifier's logit, no activation
    ce_server.wait_idle()


@pytest.mark.slow
def test_embedding_model_scores_by_cosine(embed_server: ServerProcess) -> None:
    emb = post(embed_server, "/v1/embeddings", {"input": [QUERY, *DOCS[:2]]}).json()["data"]
    vec = [np.array(d["embedding"]) for d in emb]
    score = post(embed_server, "/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()["data"]
    assert [d["score"] for d in score] == pytest.approx([float(vec[0] @ vec[1]), float(vec[0] @ vec[2])], abs=1e-5)
    rerank = post(embed_server, "/v2/rerank", {"query": QUERY, "documents": DOCS[:2]}).json()
    assert rerank["results"][0]["relevance_score"] >= rerank["results"][1]["relevance_score"]
    assert "document" not in rerank["results"][0]  # Cohere's v2 returns no documents unless asked
    embed_server.wait_idle()


@pytest.mark.slow
def test_bad_input_and_task_mismatch(ce_server: ServerProcess, embed_server: ServerProcess) -> None:
    def rerank(body: dict) -> httpx.Response:  # type: ignore[type-arg]
        return post(ce_server, "/v1/rerank", {"query": QUERY, **body})

    assert_error(rerank({"documents": []}), "documents", "non-empty list")
    assert_error(rerank({"documents": ["a", 3]}), "documents", "documents[1]: must be a string")
    assert_error(rerank({"documents": DOCS, "top_n": 0}), "top_n", "at least 1")
    assert_error(rerank({"documents": ["d"] * 2049}), "documents", "more than the 2048")
    assert_error(post(ce_server, "/rerank", {"documents": DOCS}), "query")
    assert_error(rerank({"documents": DOCS, "relevant_spans": {"mode": "enabled"}}), "relevant_spans")
    assert_error(post(ce_server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "text_1")
    assert_error(post(ce_server, "/score", {"text_1": "a", "text_2": []}), "text_2", "is empty")
    assert_error(post(ce_server, "/classify", {"input": []}), "input")
    assert_error(post(ce_server, "/classify", {"input": "x " * 200}), "input", "maximum context length is 128")
    assert post(ce_server, "/classify", {"input": "x " * 200, "truncate_prompt_tokens": 16}).status_code == 200
    # a task the server does not run: a 400 naming the mismatch
    assert_error(post(ce_server, "/v1/embeddings", {"input": "x"}), None, "runs a classify model")
    assert_error(post(embed_server, "/classify", {"input": "x"}), None, "runs an embed model")
    assert_error(post(embed_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), None, "task 'embed'")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(ce_server, "/v1/chat/completions", chat), None, "runs task 'classify'; start it with --task generate")
    ce_server.wait_idle()
    embed_server.wait_idle()
