"""vLLM's serve flags on the real `portside serve`: HTTPS with a self-signed certificate, CORS,
--root-path, --response-role, --max-logprobs, --config YAML (overridden on the command line),
--gpu-memory-utilization, the start-up banner, and the port check before the model loads."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

ORIGIN = "https://app.example"


def _self_signed(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a self-signed certificate")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return key, cert


class HttpsServer(ServerProcess):
    def __init__(self, *args: object, cert: Path, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ssl = ssl.create_default_context(cafile=str(cert))

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def get(self, path: str, **kwargs: object) -> httpx.Response:
        return httpx.get(self.url + path, verify=self.ssl, timeout=30, **kwargs)  # type: ignore[arg-type]

    def post(self, path: str, body: object) -> httpx.Response:
        return httpx.post(self.url + path, json=body, verify=self.ssl, timeout=60)

    def health(self) -> httpx.Response:
        return self.get("/health")


@pytest.fixture(scope="module")
def flagged(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsServer]:
    folder = tmp_path_factory.mktemp("flags")
    key, cert = _self_signed(folder)
    config = folder / "serve.yaml"
    config.write_text(
        "max-logprobs: 3\n"            # applied from the file
        "response_role: narrator\n"    # overridden on the command line below
        "allowed-origins: ['https://app.example']\n"
        "root-path: /proxy\n"
        "max_model_len: 256\n"
        "enable-chunked-prefill: true\n"
    )  # fmt: skip
    proc = HttpsServer(
        tiny_llama, folder / "server.log",
        "--config", str(config), "--response-role", "bot",
        # a vLLM user's command line: --gpu-memory-utilization 0.9 (max-model-len from the YAML) --disable-log-requests
        "--gpu-memory-utilization", "0.9", "--disable-log-requests", "--trust-remote-code", "--enforce-eager",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        cert=cert,
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def _chat(server: HttpsServer, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    return server.post("/v1/chat/completions", body)


@pytest.mark.slow
def test_https_with_the_self_signed_certificate(flagged: HttpsServer) -> None:
    assert flagged.get("/v1/models").json()["data"][0]["id"] == "tiny"
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets nowhere
        httpx.get(f"http://127.0.0.1:{flagged.port}/health", timeout=5).raise_for_status()


@pytest.mark.slow
def test_banner_names_what_is_served(flagged: HttpsServer, tiny_llama: Path) -> None:
    log = flagged.log()
    assert f"portside: serving {tiny_llama}\n" in log
    for part in ("architecture LlamaForCausalLM", "dtype float32", "model weights ", "device cpu",
                 "max_model_len 256", "served model name(s): tiny", f"https://127.0.0.1:{flagged.port}/proxy"):
        assert part in log, log
    blocks, size = (int(x) for x in log.split("KV cache ", 1)[1].split(" tokens", 1)[0].split(" blocks x "))
    assert f"= {blocks * size} tokens" in log
    assert "--trust-remote-code has no effect" in log


@pytest.mark.slow
def test_cors_preflight_and_headers(flagged: HttpsServer) -> None:
    pre = httpx.options(flagged.url + "/v1/chat/completions", verify=flagged.ssl, timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = flagged.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = flagged.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.slow
def test_root_path_routes_with_and_without_the_prefix(flagged: HttpsServer) -> None:
    assert flagged.get("/proxy/v1/models").status_code == 200
    assert flagged.get("/proxy/health").status_code == 200
    assert flagged.get("/v1/models").status_code == 200  # a proxy that strips the prefix
    assert flagged.get("/elsewhere/v1/models").status_code == 404


@pytest.mark.slow
def test_response_role_from_the_command_line_over_yaml(flagged: HttpsServer) -> None:
    r = _chat(flagged)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "bot"
    with httpx.stream("POST", flagged.url + "/v1/chat/completions", verify=flagged.ssl, timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as s:
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
    assert '"role":"bot"' in first.replace(" ", "")


@pytest.mark.slow
def test_max_logprobs_from_yaml(flagged: HttpsServer) -> None:
    ok = _chat(flagged, logprobs=True, top_logprobs=3)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    r = _chat(flagged, logprobs=True, top_logprobs=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert "--max-logprobs" in r.json()["error"]["message"]
    c = flagged.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 5})
    assert c.status_code == 400 and c.json()["error"]["param"] == "logprobs", c.text


def _serve(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "portside.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, time.monotonic() - start


@pytest.mark.slow
def test_port_in_use_exits_2_before_loading(tiny_llama: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc, took = _serve(str(tiny_llama), "--device", "cpu", "--port", str(port))
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} on 127.0.0.1 is in use; pick another with --port" in proc.stderr
    assert "portside: serving" not in proc.stderr and "Traceback" not in proc.stderr  # the model never loaded
    assert took < 60, took


@pytest.mark.parametrize("args, message", [
    (("--ssl-keyfile", "k.pem"), "needs both --ssl-keyfile and --ssl-certfile"),
    (("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"), "--ssl-keyfile 'k.pem' is not a file"),
    (("--allowed-methods", "GET"), "--allowed-methods configures CORS, which is off: add --allowed-origins"),
    (("--allow-credentials",), "--allow-credentials configures CORS"),
    (("--root-path", "proxy"), "--root-path 'proxy' must start with /"),
    (("--response-role", " "), "--response-role must not be empty"),
])
def test_serve_flag_errors(args: tuple[str, ...], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from portside.cli import build_parser, parse_args
    from portside.server.main import server_config, ssl_files

    monkeypatch.chdir(tmp_path)
    parsed = parse_args(build_parser(), ["serve", *args])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        server_config(parsed)
        ssl_files(parsed)


def test_cors_flags_take_json_or_comma_lists() -> None:
    from portside.cli import build_parser, parse_args
    from portside.server.main import server_config

    args = parse_args(build_parser(), ["serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
                                       "--allowed-methods", "GET,POST", "--allow-credentials"])
    config = server_config(args)
    assert config.allowed_origins == ["https://a.example", "https://b.example"]
    assert config.allowed_methods == ["GET", "POST"] and config.allowed_headers == ["*"] and config.allow_credentials
