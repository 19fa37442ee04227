"""Start the real `portside serve` in a subprocess on a free loopback port, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m portside.cli serve MODEL ...` with its log in `log_path`."""

    def __init__(self, model: Path, log_path: Path, *args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "portside.cli", "serve", str(model),
            "--device", "cpu", "--dtype", "float32", "--port", str(self.port),
            "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *args,
        ]  # fmt: skip
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text()

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=2)

    def wait_ready(self, timeout: float = 180.0) -> Self:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.health().status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples (and `name{labels}` keys) of GET /metrics."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is in use (or raise)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["portside_num_requests_running"] == 0
                and m["portside_num_requests_waiting"] == 0
                and m["portside_kv_cache_used_blocks"] == 0
            )
            if idle or time.monotonic() > deadline:
                assert idle, f"server not idle: { {k: v for k, v in m.items() if 'bucket' not in k} }"
                return m
            time.sleep(0.1)

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
