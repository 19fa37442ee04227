"""Multi-token-prediction (MTP) layers shipped inside a checkpoint (DeepSeek-V3, GLM-4.5): the
tensors of ``model.layers.{num_hidden_layers + i}.*`` are set aside, unchanged, for a
speculative-decoding proposer instead of being loaded into (or refused by) the decoder."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

__all__ = ["without_mtp"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def without_mtp(
    weights: Iterable[tuple[str, torch.Tensor]], num_layers: int, num_mtp_layers: int,
    keep: dict[str, torch.Tensor] | None, owner: str,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """`weights` less the MTP layers' tensors, which go into `keep` (None: dropped, as on a
    pipeline stage other than the last); a tensor of a layer past them is refused, naming it."""
    for name, tensor in weights:
        m = _LAYER.match(name)
        if m is None or int(m[1]) < num_layers:
            yield name, tensor
        elif int(m[1]) < num_layers + num_mtp_layers:
            if keep is not None:
                keep[name] = tensor
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {owner}: layer {m[1]} is past its "
                             f"{num_layers} layers and {num_mtp_layers} multi-token-prediction layers")
