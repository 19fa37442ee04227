"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the attention layer whose KV cache holds one
compressed row per token, ``[c_kv (kv_lora_rank), k_pe (qk_rope_head_dim)]``, not K and V.

Projections (Hugging Face names under ``self_attn.``):

- queries: ``q_proj`` [H * (nope + rope), hidden], or with a query LoRA (``q_lora_rank``)
  ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; each head's query is ``[q_nope, q_pe]``;
- keys and values: ``kv_a_proj_with_mqa`` [kv_lora_rank + rope, hidden] gives the latent ``c_kv``
  (normalised by ``kv_a_layernorm``) and one rotary key ``k_pe`` shared by every head;
  ``kv_b_proj`` [H * (nope + v), kv_lora_rank] would expand ``c_kv`` into each head's ``k_nope``
  (its W_UK rows) and value (its W_UV rows);
- ``o_proj`` [hidden, H * v].

Attention runs in the absorbed form, prefill and decode alike: each head's ``q_nope`` is multiplied
by its W_UK block first (``q_nope . (W_UK c) = (q_nope W_UK) . c``), so the scores are taken against
the cached rows themselves, and the output (a weighted sum of ``c_kv`` rows) is multiplied by the
head's W_UV block after: K and V are never materialised, and the backend's `latent_attention`
(`portside.contract.LatentAttention`) reads only the latent cache. W_UK and W_UV are views of
``kv_b_proj``'s weight (dequantized once where a checkpoint quantizes it, as vLLM does).

Rotary: DeepSeek rotates the rope dims as interleaved pairs ``(x0, x1), (x2, x3), ...`` (V2's
complex multiply; V3 with ``rope_interleave``, its default); V3 without it as halves (GPT-NeoX).
The pairs are de-interleaved before rotating, in queries and cached keys alike, which leaves every
score as transformers computes it. The softmax scale is ``(nope + rope) ** -0.5``, times YaRN's
``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling (transformers' ``yarn_apply_mscale``).

Tensor parallelism: heads are split over the ranks (q_b_proj / q_proj, kv_b_proj column-parallel,
o_proj row-parallel); q_a_proj, kv_a_proj_with_mqa and the latent cache are replicated.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from portside.model.args import ModelArgs, RopeScaling
from portside.model.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear
from portside.model.rotary import apply_rotary

__all__ = ["MLAttention", "mla_softmax_scale"]


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` under a rope scaling with ``mscale_all_dim``
    (YaRN; DeepSeek scales the whole score, not only the rotary dims)."""
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    """One MLA layer: x [T, hidden] -> (queries [T, H, L + R], latent rows [T, L + R]) with `qkv`,
    the backend attends (`latent_attention`), and `out` maps its output [T, H, L] to [T, hidden]."""

    def __init__(self, args: ModelArgs, layer_idx: int, tp: Any, dtype: torch.dtype, interleaved: bool = True) -> None:
        super().__init__()
        hf = args.hf_config
        H, hidden = args.num_heads, args.hidden_size
        if H % tp.size:
            raise ValueError(f"{H} attention heads do not split over {tp.size} tensor-parallel ranks")
        self.layer_idx = layer_idx
        self.num_heads = H // tp.size  # this rank's
        self.nope, self.rope = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        self.v_dim, self.latent_dim = int(hf.v_head_dim), int(hf.kv_lora_rank)
        self.q_lora_rank = getattr(hf, "q_lora_rank", None)
        self.interleaved = interleaved
        bias, eps, qk = bool(getattr(hf, "attention_bias", False)), args.rms_norm_eps, self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, H * qk, False, tp.rank, tp.size, dtype)
        else:
            self.q_proj = ColumnParallelLinear(hidden, H * qk, False, tp.rank, tp.size, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.latent_dim + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.latent_dim, H * (self.nope + self.v_dim), False, tp.rank, tp.size, dtype)
        self._kv_b_dense: torch.Tensor | None = None  # kv_b_proj's weight, dequantized once, if quantized
        self.o_proj = RowParallelLinear(H * self.v_dim, hidden, bias, tp.rank, tp.size, dtype, tp.comm)
        self.scale = mla_softmax_scale(qk, args.rope_scaling)
        self.features: dict[str, Any] = {}  # none of ATTENTION_FEATURES

    @property
    def head_size(self) -> int:
        """Values per cached row (and per absorbed query head): kv_lora_rank + rope dims."""
        return self.latent_dim + self.rope

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's W_UK [H, nope, L] and W_UV [H, v, L]: views of kv_b_proj's weight. A
        quantized kv_b_proj (block-FP8 checkpoints) is dequantized once, through the platform's
        own quantized linear applied to the identity, and kept dense beside its codes."""
        w: torch.Tensor | None = self.kv_b_proj.weight
        if w is None:
            if self._kv_b_dense is None:
                eye = torch.eye(self.latent_dim, dtype=self.kv_b_proj.dtype, device=self.kv_a_layernorm.weight.device)
                self._kv_b_dense = self.kv_b_proj.matmul(eye).t().contiguous()  # [H * (nope + v), L]
            w = self._kv_b_dense
        w = w.view(self.num_heads, self.nope + self.v_dim, self.latent_dim)
        return w[:, : self.nope], w[:, self.nope :]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on x [T, h, R]: interleaved pairs de-interleaved first (see the module doc)."""
        if self.interleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, cos, sin)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (queries [T, H, L + R]: [q_nope W_UK, rotated q_pe] per head; latent
        rows [T, L + R]: [kv_a_layernorm(c_kv), rotated k_pe])."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope], dim=-1)
        w_uk, _ = self._absorb_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        query = torch.cat((q_latent, self._rotate(q_pe, cos, sin)), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), self._rotate(k_pe.unsqueeze(1), cos, sin).squeeze(1)), dim=-1)
        return query, latent

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output over the latent, o [T, H, L] -> [T, hidden] (W_UV, then o_proj)."""
        _, w_uv = self._absorb_weights()
        v = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(v.reshape(o.shape[0], self.num_heads * self.v_dim))
