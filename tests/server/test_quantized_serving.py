"""`portside serve --quantization int8`: the start-up log and `/metrics` report the loaded
weights' bytes, a quarter of the fp32 server's for the linears; completions are served."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # its own server on a quantized checkpoint (CI runs it)


def test_quantized_server_reports_its_weight_memory(server: ServerProcess, tiny_llama: Path, tmp_path: Path) -> None:
    dense = server.metrics()["portside_model_weight_bytes"]
    proc = ServerProcess(tiny_llama, tmp_path / "q.log", "--quantization", "int8", "--num-kv-blocks", "64")
    try:
        proc.wait_ready()
        quantized = proc.metrics()["portside_model_weight_bytes"]
        assert 0 < quantized < dense
        log = proc.log()
        m = re.search(r"model weights ([0-9.]+) MiB", log)
        assert m and "int8" in log, log[-3000:]
        assert abs(float(m[1]) * 2**20 - quantized) < 0.1 * 2**20
        r = httpx.post(proc.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        proc.kill()
