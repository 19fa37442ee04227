"""Read Hugging Face safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["safetensors_files", "iterate_safetensors", "load_checkpoint"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint files of `folder`: the shards named by the index, else model.safetensors,
    else every *.safetensors file. Raises FileNotFoundError when there are none."""
    folder = Path(folder)
    index = folder / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / _SINGLE).is_file():
        return [folder / _SINGLE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder} (expected {_SINGLE} or {_INDEX})")
    return files


def _progress(total: int, desc: str):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not sys.stderr.isatty(), leave=False)


def iterate_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every shard, one at a time (memory-mapped)."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with _progress(total, f"loading {Path(folder).name}") as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_checkpoint(model: torch.nn.Module, folder: str | Path) -> None:
    """Fill `model` (which has `load_weights` and `check_loaded`) from the folder's safetensors.
    A tensor with no place, a wrong shape or a missing tensor raises ValueError naming the folder."""
    try:
        loaded = model.load_weights(iterate_safetensors(folder))  # type: ignore[operator]
        model.check_loaded(loaded)  # type: ignore[operator]
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
