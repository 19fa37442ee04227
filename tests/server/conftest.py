"""The shared server for tests/server: the real `portside serve` on a tiny model, with an API key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess

API_KEY = "sk-portside-test-key"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(
        tiny_llama, log,
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--num-kv-blocks", "1200",
        "--max-num-seqs", "64", "--max-waiting-requests", "256", "--max-request-body-bytes", "65536",
        api_key=API_KEY,
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def client(server: ServerProcess):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient(server: ServerProcess):  # type: ignore[no-untyped-def]
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
