"""Shared fixtures. Keep this small: fixtures used by one test file belong in that file."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama HF folder (config, safetensors, ChatML tokenizer), fp32."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen2 HF folder (qkv bias), fp32."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")
