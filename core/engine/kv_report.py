"""What a model keeps per token and per sequence, and how many sequences a KV-cache budget holds:
the budget report of `portside devices --model` (the engine logs the same at start-up).

A model's cache is two groups: its attention layers' paged K/V (bytes per token, `KVCacheSpec`;
for latent attention, MLA, one compressed row per token and layer, `LatentKVCacheSpec`) and its
recurrent layers' fixed state (bytes per sequence, `StateSpec`; hybrid models only). The model is
built on the meta device, so no weight is read and no memory is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from portside.contract import KVCacheSpec, LatentKVCacheSpec, StateSpec, kv_cache_torch_dtype

__all__ = ["CacheReport", "cache_report"]

MiB = 2**20


@dataclass(frozen=True)
class CacheReport:
    architecture: str
    num_layers: int
    kv: KVCacheSpec
    state: StateSpec | None

    @property
    def bytes_per_token(self) -> int:
        """K and V of every attention layer for one token."""
        return self.kv.bytes_per_token if self.kv.num_layers else 0

    @property
    def state_bytes_per_sequence(self) -> int:
        """Every recurrent layer's state for one sequence (0 without recurrent layers)."""
        return self.state.bytes_per_slot if self.state is not None else 0

    def bytes_per_sequence(self, num_tokens: int) -> int:
        """One sequence of `num_tokens` tokens: its K/V plus its recurrent state."""
        return num_tokens * self.bytes_per_token + self.state_bytes_per_sequence

    def tokens(self, budget: float) -> int:
        """Tokens whose K/V (or latent rows) fit in `budget` bytes (no recurrent state counted)."""
        return int(budget // self.bytes_per_token) if self.bytes_per_token else 0

    def sequences(self, budget: float, num_tokens: int) -> int | None:
        """Sequences of `num_tokens` tokens that fit in `budget` bytes at once (None: no limit, the
        model keeps nothing per sequence: an encoder-only model)."""
        per_sequence = self.bytes_per_sequence(num_tokens)
        return int(budget // per_sequence) if per_sequence else None

    def format(self, budget: float, num_tokens: int) -> str:
        lines = [f"{self.architecture}: {self.num_layers} layers"]
        if isinstance(self.kv, LatentKVCacheSpec) and self.kv.num_layers:
            lines.append(f"  latent attention (MLA): {self.kv.num_layers} layers, one row of {self.kv.latent_dim} latent + "
                         f"{self.kv.rope_dim} rotary values per token, {self.bytes_per_token / 1024:.1f} KiB per token")
        elif self.kv.num_layers:
            lines.append(f"  full attention: {self.kv.num_layers} layers, {self.kv.num_kv_heads} KV heads x "
                         f"{self.kv.head_size}, {self.bytes_per_token / 1024:.1f} KiB per token")
        if self.state is not None:
            shapes = " + ".join("x".join(map(str, s)) for s in self.state.shapes)
            lines.append(f"  {self.state.kind} (recurrent state): {self.state.num_layers} layers, {shapes} per layer, "
                         f"{self.state_bytes_per_sequence / MiB:.2f} MiB per sequence")
        if self.kv.num_layers:
            lines.append(f"  {budget / MiB:.0f} MiB hold {self.tokens(budget)} tokens of K/V")
        if self.sequences(budget, num_tokens) is None:
            lines.append("  no KV cache: an encoder-only model attends over each whole prompt in one step and keeps "
                         "nothing between steps")
            return "\n".join(lines)
        lines.append(f"  {budget / MiB:.0f} MiB hold {self.sequences(budget, num_tokens)} sequences of {num_tokens} tokens "
                     f"({self.bytes_per_sequence(num_tokens) / MiB:.2f} MiB each)")
        return "\n".join(lines)


def cache_report(model: str | Path, dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto",
                 mamba_ssm_cache_dtype: str = "auto") -> CacheReport:
    """The cache groups of the model at `model` (a Hugging Face folder), built on the meta device."""
    import dataclasses

    from portside.model.registry import model_class, read_model_args
    from portside.runner.kv_cache import check_latent_kv_cache_dtype

    args = dataclasses.replace(read_model_args(model), mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
    with torch.device("meta"):
        m = model_class(args.architecture)(args, dtype=dtype)
    kv: KVCacheSpec = m.kv_cache_spec()  # type: ignore[operator]
    check_latent_kv_cache_dtype(kv_cache_dtype, kv, args.architecture)
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, kv.dtype)
    if cache_dtype != kv.dtype:
        kv = dataclasses.replace(kv, cache_dtype=cache_dtype)
    spec_fn = getattr(m, "state_spec", None)
    state = spec_fn() if spec_fn is not None else None
    return CacheReport(args.architecture, args.num_layers, kv, state if state is not None and state.num_layers else None)
