"""The server applies a model's generation_config.json sampling defaults (`--generation-config`)
to the fields a request leaves unset; the request's own values stand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

PROMPT = "the quick brown fox"
# greedy, so outputs compare exactly; the penalty makes "applied" visible in the tokens too
GEN = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def gen_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gen_model") / "model"
    shutil.copytree(tiny_llama, folder)
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**(json.loads(file.read_text()) if file.is_file() else {}), **GEN}))
    return folder


def test_server_fills_only_the_fields_a_request_leaves_unset(gen_model):
    from fastapi.testclient import TestClient
    from openai_schemas import validate

    from portside.engine.llm_engine import LLMEngine
    from portside.server.app import ServerConfig, build_app

    engine = LLMEngine.from_args(model=str(gen_model), device="cpu", num_kv_blocks=64)
    with TestClient(build_app(engine, ServerConfig(served_model_names=["m"]))) as client:
        def complete(**fields: object) -> dict:
            r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, **fields})
            assert r.status_code == 200, r.text
            validate("CreateCompletionResponse", r.json())
            return r.json()

        unset = complete()  # temperature, repetition_penalty and max_tokens from the generation config
        explicit = complete(temperature=0.0, repetition_penalty=1.3, max_tokens=6)
        assert unset["choices"][0]["text"] == explicit["choices"][0]["text"]
        assert unset["usage"]["completion_tokens"] <= 6
        # a request's own max_tokens stands over the model's 6 (ignore_eos so the length is exact)
        assert complete(temperature=0.0, max_tokens=9, ignore_eos=True)["usage"]["completion_tokens"] == 9
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        validate("CreateChatCompletionResponse", r.json())
        assert r.json()["usage"]["completion_tokens"] <= 6  # max_new_tokens caps a request that sets no limit
