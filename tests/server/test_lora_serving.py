"""LoRA adapters through the real server: `--lora-modules` served by name (greedy text equal to
transformers + peft), listed in /v1/models, loaded and unloaded at run time, and an adapter in
use never unloaded under its requests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_process import ServerProcess

from portside.testing.tiny import make_tiny_lora

pytestmark = pytest.mark.slow  # its own LoRA server and a peft oracle (CI runs it)


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served_adapters")
    return {name: make_tiny_lora(tiny_llama, root / name, r=r, seed=seed) for name, r, seed in
            (("sql", 8, 11), ("chat", 4, 12), ("late", 8, 13))}


@pytest.fixture(scope="module")
def srv(tiny_llama: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("lora_srv") / "server.log"
    chat = json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": "tiny"})
    proc = ServerProcess(
        tiny_llama, log, "--max-model-len", "256", "--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql']}", chat, "--allow-runtime-lora-updating",
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


@torch.no_grad()
def peft_greedy(base: Path, adapter: Path, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32), adapter).eval()
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def complete(srv: ServerProcess, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": [5, 17, 42, 9, 33, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0} | extra
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)


def tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_served_adapters_match_peft_and_are_listed(srv: ServerProcess, tiny_llama: Path, adapters: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    models = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]}
    assert set(models) == {"tiny", "sql", "chat"}
    assert models["sql"]["parent"] == "tiny" and models["sql"]["root"] == str(adapters["sql"])
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = [5, 17, 42, 9, 33, 8]
    for name in ("sql", "chat"):
        want = [tok.decode([t]) for t in peft_greedy(tiny_llama, adapters[name], prompt, 8)]
        assert tokens(complete(srv, name)) == want, name
    assert tokens(complete(srv, "sql")) != tokens(complete(srv, "tiny"))
    r = complete(srv, "nope")
    assert r.status_code == 404 and "sql" in r.json()["error"]["message"]


def test_load_use_and_unload_at_run_time(srv: ServerProcess, adapters: dict[str, Path]) -> None:
    url = srv.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}, timeout=60)
    assert r.status_code == 200, r.text
    assert "late" in {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
    assert complete(srv, "late").status_code == 200
    dup = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}, timeout=10)
    assert dup.status_code == 400
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"

    # an adapter a request is using is not unloaded under it
    started = threading.Event()
    result: dict[str, object] = {}

    def long_stream() -> None:
        body = {"model": "late", "prompt": "the fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as s:
            text = ""
            for line in s.iter_lines():
                started.set()
                text += line
            result["done"] = "[DONE]" in text and '"error"' not in text

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(30)
    busy = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=10)
    assert busy.status_code == 409, busy.text
    t.join()
    assert result["done"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=10).status_code == 200
    assert complete(srv, "late").status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=10).status_code == 404
    srv.wait_idle()


def test_runtime_updates_need_the_flags(server: ServerProcess) -> None:
    """The shared server has no --enable-lora: the endpoints say what is missing."""
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}, headers=server.headers, timeout=10)
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_two_adapters_and_the_base_answer_concurrently(srv: ServerProcess, tiny_llama: Path,
                                                        adapters: dict[str, Path]) -> None:
    """Requests for both adapters and the base model fired at once (one batch of mixed adapters)
    answer what each answers alone, which is transformers' (+ peft's) greedy continuation."""
    from transformers import AutoTokenizer

    from portside.testing.tiny import hf_greedy

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = [5, 17, 42, 9, 33, 8]
    n = 32
    want = {"tiny": [tok.decode([t]) for t in hf_greedy(tiny_llama, prompt, n)]}
    for name in ("sql", "chat"):
        want[name] = [tok.decode([t]) for t in peft_greedy(tiny_llama, adapters[name], prompt, n)]
    assert len({tuple(v) for v in want.values()}) == 3  # three different answers: a mix-up shows
    for name, expected in want.items():
        assert tokens(complete(srv, name, max_tokens=n)) == expected, f"{name} alone"

    names = ["sql", "tiny", "chat"] * 4
    barrier = threading.Barrier(len(names))
    results: dict[int, httpx.Response] = {}

    def fire(i: int, name: str) -> None:
        barrier.wait()
        results[i] = complete(srv, name, max_tokens=n)

    def steps() -> float:  # engine steps so far (the tokens-per-step histogram's count)
        return sum(v for k, v in srv.metrics().items() if k.startswith("vllm:iteration_tokens_total_count"))

    before = steps()
    threads = [threading.Thread(target=fire, args=(i, name)) for i, name in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == len(names)
    taken = steps() - before
    # they really shared batches: one request at a time would take a step per token (384)
    assert 0 < taken <= len(names) * n / 3, taken
    for i, name in enumerate(names):
        assert tokens(results[i]) == want[name], f"request {i} ({name}) in the concurrent batch"
    srv.wait_idle()


def _load(srv: ServerProcess, name: str, path: Path) -> httpx.Response:
    return httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def _model_cards(srv: ServerProcess) -> list[dict[str, object]]:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]


def test_bad_adapters_loaded_at_run_time_are_refused(srv: ServerProcess, tiny_llama: Path, adapters: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """An adapter of a rank above --max-lora-rank and one whose weights are garbage: a 400 naming
    the problem, /v1/models unchanged, the name not taken, the server idle and still serving."""
    models = _model_cards(srv)
    big = make_tiny_lora(tiny_llama, tmp_path / "big", r=16, seed=14)  # the server's --max-lora-rank is 8
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((adapters["sql"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x93garbage, not a safetensors file" * 40)

    r = _load(srv, "big", big)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and "rank 16 is above the maximum LoRA rank 8" in err["message"]
    assert "--max-lora-rank" in err["message"]

    r = _load(srv, "corrupt", corrupt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and str(corrupt) in err["message"] and "unreadable" in err["message"]

    assert _model_cards(srv) == models
    for name in ("big", "corrupt"):
        assert complete(srv, name).status_code == 404
    srv.wait_idle()
    # nothing of the failed loads stays behind: the name is free, the server serves as before
    r = _load(srv, "corrupt", adapters["late"])
    assert r.status_code == 200, r.text
    assert complete(srv, "corrupt").status_code == 200 and complete(srv, "sql").status_code == 200
    assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "corrupt"}, timeout=10).status_code == 200
    assert _model_cards(srv) == models
    srv.wait_idle()
