"""What a pooling model does with its pooled states [B, hidden] (fp32) on the runner's device:
task embed: the sentence-transformers Dense layers, then L2 normalisation (`PoolerConfig.normalize`);
classify / reward: the model's classifier (`model.classify`, `num_labels` logits), or the LM head's
logits of `PoolerConfig.from_token_ids` (two tokens: one logit, the second's minus the first's, as
vLLM's from-2-way-softmax conversion of Qwen3-Reranker). Activations (softmax / sigmoid) are the
front end's (`portside.pooling.outputs`), so every API can read the raw logits too."""

from __future__ import annotations

from typing import Any

import torch

from portside.config import PoolerConfig
from portside.pooling.st_folder import DenseLayer


class PoolingHead:
    def __init__(self, config: PoolerConfig, model: Any, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.dense = [DenseLayer(folder, device) for folder in config.dense]
        if config.task != "embed" and not config.from_token_ids and not hasattr(model, "classify"):
            raise ValueError(f"{type(model).__name__} has no classifier for task {config.task}")

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] fp32 -> [B, out] fp32."""
        cfg = self.config
        if cfg.task == "embed":
            x = pooled
            for layer in self.dense:
                x = layer(x)
            return torch.nn.functional.normalize(x, p=2.0, dim=-1) if cfg.normalize else x
        dtype = getattr(self.model, "dtype", pooled.dtype)
        if cfg.from_token_ids:
            logits = self.model.compute_logits(pooled.to(dtype)).float()[:, list(cfg.from_token_ids)]
            return logits[:, 1:] - logits[:, :1] if len(cfg.from_token_ids) == 2 else logits
        return self.model.classify(pooled.to(dtype)).float()
