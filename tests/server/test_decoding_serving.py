"""Decoding strategies through `portside serve`: a server with `--speculative-config` (ngram, and
a draft model) answers greedy completions (streamed and not) with transformers' tokens and counts proposals in vLLM's
`vllm:spec_decode_*` series; a bad config exits 2 naming the problem."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import post, sse_events
from openai_schemas import validate
from server_process import ServerProcess

from portside.testing.tiny import hf_greedy, make_draft_model

pytestmark = pytest.mark.slow
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
                request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("spec_server")
    spec = SPEC if request.param == "ngram" else \
        {"model": str(make_draft_model(tiny_llama, folder / "draft", noise_std=0.01)), "num_speculative_tokens": 3}
    proc = ServerProcess(tiny_llama, folder / "server.log", "--max-model-len", "256", "--block-size", "4",
                         "--num-kv-blocks", "400", "--speculative-config", json.dumps(spec))
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def test_speculative_server_gives_transformers_greedy_tokens(spec_server: ServerProcess, server: ServerProcess,
                                                            tiny_llama: Path) -> None:
    """The text equals the plain server's (whose tokens are checked against transformers
    elsewhere) and transformers' tokens decoded (up to a character still incomplete at the end)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    base = tok("the quick brown fox jumps over").input_ids
    ids = base + hf_greedy(tiny_llama, base, 10) + base  # quotes the continuation: proposals find it
    want = hf_greedy(tiny_llama, ids, 20)
    request = {"model": "tiny", "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = post(spec_server, "/v1/completions", request)
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["text"] == post(server, "/v1/completions", request).json()["choices"][0]["text"]
    assert tok.decode(want, skip_special_tokens=True).startswith(choice["text"].rstrip("\ufffd"))
    assert len(choice["logprobs"]["tokens"]) == 20 and body["usage"]["completion_tokens"] == 20
    events = sse_events(spec_server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 20,
                                                         "temperature": 0, "ignore_eos": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
    m = spec_server.wait_idle()
    drafts = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    proposed = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total"))
    accepted = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert drafts > 0 and proposed >= accepted >= 0
    assert any(k.startswith('vllm:spec_decode_num_accepted_tokens_per_pos_total{') for k in m)


@pytest.mark.parametrize("value,message", [
    ('{"method": "eagle9", "num_speculative_tokens": 2}', "unknown method 'eagle9'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer from 1"),
    ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "draft model path '/no/such/draft' does not exist"),
    ("ngram", "not valid JSON"),
])
def test_bad_speculative_config_exits_2(tiny_llama: Path, value: str, message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from portside.cli import main

    code = main(["serve", str(tiny_llama), "--device", "cpu", "--port", "0", "--speculative-config", value])
    assert code == 2 and message in capsys.readouterr().err


# ---- beam search (the shared server) ---------------------------------------------------------------


def test_use_beam_search_on_completions_and_chat(server: ServerProcess, tiny_llama: Path) -> None:
    """n beams, best first, equal to LLM.beam_search (itself checked against transformers);
    chat through the chat template; usage counts every returned beam's tokens."""
    from transformers import AutoTokenizer

    from portside import BeamSearchParams
    from portside.engine.beam_search import BeamSearchState
    from portside.testing.tiny import hf_logits

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok("the quick brown fox jumps over").input_ids
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "n": 3, "max_tokens": 6, "use_beam_search": True,
                                         "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)

    # the same search with transformers' logits as the engine (fp32: the same ranking)
    state = BeamSearchState(ids, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5), [tok.eos_token_id], 256)
    from portside.outputs import Logprob

    while not state.done:
        tops = []
        for beam in state.beam_prompts():
            lp = hf_logits(tiny_llama, beam)[-1].log_softmax(-1)
            vals, toks = lp.topk(6)
            tops.append({t: Logprob(v) for t, v in zip(toks.tolist(), vals.tolist())})
        state.advance(tops)
    want = state.sequences(lambda g: tok.decode(g, skip_special_tokens=True))
    assert [c["text"] for c in body["choices"]] == [s.text for s in want]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == sum(len(s.tokens) - len(ids) for s in want)

    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}],
                                                 "n": 2, "max_tokens": 5, "use_beam_search": True})
    assert chat.status_code == 200, chat.text
    validate("CreateChatCompletionResponse", chat.json())
    assert len(chat.json()["choices"]) == 2
    server.wait_idle()
