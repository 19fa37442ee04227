"""GGUF checkpoints: convert to a Hugging Face folder (placeholder, filled in below)."""

from __future__ import annotations

from pathlib import Path


def resolve_model_path(path: str | Path) -> Path:
    return Path(path)
