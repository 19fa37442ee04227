"""EAGLE heads: one decoder layer that drafts from the target's hidden states.

Two published layouts, read as their authors write them:

- **EAGLE-1/2** (`yuhuili/EAGLE-llama2-chat-7B`): a Llama `config.json` and a checkpoint
  (`pytorch_model.bin` or safetensors) with ``fc.weight`` / ``fc.bias`` (2 * hidden -> hidden) and
  ``layers.0.*`` whose first norm is absent. A row's input is ``fc(cat(embed(token), hidden))``
  where `hidden` is the target's final (normed) hidden state of the position before; the layer's
  output goes, unnormed, through the target's LM head. Embeddings: the checkpoint's
  ``embed_tokens`` when it has one, else the target's.
- **EAGLE-3** (`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`, RedHatAI's speculators heads: architecture
  ``LlamaForCausalLMEagle3``): ``fc.weight`` (3 * target hidden -> hidden) fuses the residual
  streams entering three target layers (``eagle_config.eagle_aux_hidden_state_layer_ids``, else
  2, L // 2 and L - 3); the layer (``midlayer.*`` or ``layers.0.*``) attends over
  ``cat(input_layernorm(embed), hidden_norm(hidden))`` (2 * hidden wide); its own ``norm`` and
  ``lm_head`` over ``draft_vocab_size`` tokens, mapped to the target's vocabulary by ``d2t``
  (target id = draft id + d2t[draft id]; ``t2d`` is not needed to draft).

Either way a drafted row returns (hidden for the logits, the residual stream that the next
chained row takes as its `hidden`). The layer's attention is paged through the platform's
attention backend like any model's (one cache layer, `kv_cache_spec`).
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portside.contract import ForwardContext, KVCacheSpec
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, GatedMLP
from portside.model.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    VocabParallelEmbedding,
    default_weight_loader,
)
from portside.model.rotary import RotaryEmbedding, apply_rotary

__all__ = ["EagleHead", "EagleHeadConfig", "iterate_head_checkpoint"]

_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


@dataclass(frozen=True)
class EagleHeadConfig:
    """A head's folder read and checked against its target (`read`)."""

    path: str
    method: str  # "eagle" or "eagle3"
    args: ModelArgs  # the head's layer (its hidden size, heads, rope)
    target_hidden_size: int
    draft_vocab_size: int  # eagle3: its own LM head's vocabulary (eagle: the target's)
    aux_layer_ids: tuple[int, ...]  # eagle3: the target layers whose input streams `fc` fuses
    norm_before_residual: bool = False  # eagle3: the residual is the normed hidden state

    @classmethod
    def read(cls, path: str, method: str, target: dict[str, Any], max_model_len: int) -> EagleHeadConfig:
        """The head at `path`, checked against the target's config.json `target`; ValueError
        naming what does not fit (hidden size, vocabulary, layer ids, layout)."""
        folder = Path(path)
        try:
            hf = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"speculative_config: the {method} head {path!r} has no readable config.json ({e})") from None
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if method == "eagle" and arch in EAGLE3_ARCHS:
            raise ValueError(f"speculative_config: {path!r} is an EAGLE-3 head ({arch}); use method 'eagle3'")
        layers = int(hf.get("num_hidden_layers") or 1)
        if layers != 1:
            raise ValueError(f"speculative_config: the {method} head {path!r} has {layers} layers; portside runs "
                             "heads of one decoder layer (the published EAGLE and EAGLE-3 layout)")
        t_hidden, t_vocab, t_layers = int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])
        hidden = int(hf["hidden_size"])
        head_target_hidden = int(hf.get("target_hidden_size") or hidden)
        if head_target_hidden != t_hidden or (method == "eagle" and hidden != t_hidden):
            raise ValueError(f"speculative_config: the {method} head's hidden size ({head_target_hidden}) does not fit "
                             f"the target's ({t_hidden}); use a head trained for this target")
        vocab = int(hf.get("vocab_size") or t_vocab)
        if vocab != t_vocab:
            raise ValueError(f"speculative_config: the {method} head's vocabulary ({vocab} tokens) is not the target's "
                             f"({t_vocab}); use a head trained for this target's tokenizer")
        draft_vocab = int(hf.get("draft_vocab_size") or vocab) if method == "eagle3" else vocab
        ids: tuple[int, ...] = ()
        if method == "eagle3":
            eagle = hf.get("eagle_config") or {}
            given = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
            ids = tuple(int(i) for i in given) if given else (2, t_layers // 2, t_layers - 3)
            if len(ids) != 3 or not all(0 <= i < t_layers for i in ids):
                raise ValueError(f"speculative_config: the eagle3 head's auxiliary layer ids {list(ids)} do not fit the "
                                 f"target's {t_layers} layers (three ids from 0 to {t_layers - 1}; set "
                                 "eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
        hf = dict(hf, vocab_size=vocab, architectures=["LlamaForCausalLM"])
        args = ModelArgs.from_hf(types.SimpleNamespace(**hf), max_model_len=max_model_len)
        return cls(path=str(folder), method=method, args=args, target_hidden_size=t_hidden, draft_vocab_size=draft_vocab,
                   aux_layer_ids=ids, norm_before_residual=bool(hf.get("norm_before_residual", False)))


def iterate_head_checkpoint(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A head's tensors: its safetensors, else `pytorch_model.bin` (EAGLE-1's published format,
    read with ``weights_only``)."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")):
        from portside.model.loader import iterate_safetensors

        yield from iterate_safetensors(folder)
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{folder}: no head checkpoint (expected *.safetensors or pytorch_model.bin)")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


class EagleHead(nn.Module):
    """The head's modules (see the module doc). `embed` and `lm_head` are the target's where the
    head has none (`load`)."""

    d2t: torch.Tensor  # registered buffer [draft vocab] int64 (EAGLE-3): target id - draft id

    def __init__(self, cfg: EagleHeadConfig, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        a = cfg.args
        h = a.hidden_size
        self.eagle3 = cfg.method == "eagle3"
        self.fc = nn.Linear((3 * cfg.target_hidden_size) if self.eagle3 else 2 * h, h, bias=not self.eagle3, dtype=dtype)
        self.self_attn = DecoderAttention(a, 0, tp, dtype, None, RMSNorm)
        if self.eagle3:  # the layer's q/k/v read cat(embeds, hidden)
            self.self_attn.qkv_proj = QKVParallelLinear(2 * h, a.head_dim, a.num_heads, a.num_kv_heads, a.qkv_bias,
                                                        tp.rank, tp.size, dtype)
            self.input_layernorm = RMSNorm(h, a.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(h, a.rms_norm_eps, dtype)
            self.norm = RMSNorm(h, a.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h, tp.rank, tp.size, dtype, tp.comm)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.post_attention_layernorm = RMSNorm(h, a.rms_norm_eps, dtype)
        self.mlp = GatedMLP(h, a.intermediate_size, a.mlp_bias, a.hidden_act, tp, dtype)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings, a.max_model_len)
        self.embed_tokens: VocabParallelEmbedding | None = VocabParallelEmbedding(
            a.vocab_size, h, tp.rank, tp.size, dtype, tp.comm)
        self._target_embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.self_attn
        return KVCacheSpec(num_layers=1, num_kv_heads=attn.num_kv_heads, head_size=attn.head_dim, dtype=self.dtype)

    # ---- loading ------------------------------------------------------------------------

    def load(self, target: Any) -> None:
        """Fill from the head's checkpoint; the embedding (and EAGLE-1's LM head) the target's
        where the checkpoint has none. ValueError naming a tensor with no place, a wrong shape or
        a missing one."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in iterate_head_checkpoint(self.cfg.path):
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.").removeprefix("layers.0.")
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "d2t" and self.eagle3:
                self.d2t.copy_(tensor.to(torch.int64))
                loaded.add(("d2t", None))
                continue
            if name == "lm_head.weight" and not self.eagle3:
                continue  # some EAGLE-1 folders keep a copy of the target's head
            shard: object = None
            for old, new, sid in _STACKED:
                if f".{old}." in f".{name}":
                    name, shard = name.replace(old, new), sid
                    break
            if name not in params:
                raise ValueError(f"{self.cfg.path}: checkpoint tensor {name!r} has no place in a {self.cfg.method} head")
            param = params[name]
            try:
                with torch.no_grad():
                    loader = getattr(param, "weight_loader", default_weight_loader)
                    loader(param, tensor.to(param.dtype), shard)
            except (ValueError, RuntimeError, IndexError) as e:
                raise ValueError(f"{self.cfg.path}: checkpoint tensor {name!r} {tuple(tensor.shape)}: {e}") from None
            loaded.add((name, shard))
        if ("embed_tokens.weight", None) not in loaded:
            self.embed_tokens = None
            self._target_embed = target.embed_input_ids
        if not self.eagle3:
            self._target_logits = target.compute_logits
        if self.eagle3 and ("d2t", None) in loaded:
            ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
            vocab = int(target.config.vocab_size)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise ValueError(f"{self.cfg.path}: the eagle3 head's d2t maps its draft vocabulary to token ids "
                                 f"{int(ids.min())}..{int(ids.max())}, outside the target's vocabulary (0..{vocab - 1}); "
                                 "use a head trained for this target's tokenizer")
        expected = {(n, s) for n, p in self.named_parameters() for s in (getattr(p, "shard_ids", None) or [None])}
        expected |= {("d2t", None)} if self.eagle3 else set()
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"{self.cfg.path}: the {self.cfg.method} head's checkpoint is missing {missing[:5]}")

    # ---- forward ------------------------------------------------------------------------

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's three auxiliary streams [T, 3 * target hidden] -> [T, hidden]."""
        return self.fc(aux.to(self.dtype))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        assert self._target_embed is not None
        return self._target_embed(ids)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token, position, hidden [T, hidden]) -> (hidden for the logits, residual stream
        for the next chained row), the layer's K/V written at the rows' slots."""
        emb = self.embed(ids)
        cos, sin = self.rotary(positions, emb.dtype)
        if self.eagle3:
            normed = self.hidden_norm(hidden)
            residual = normed if self.cfg.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        else:
            x = residual = self.fc(torch.cat([emb, hidden], dim=-1))
        attn = self.self_attn
        T, D = x.shape[0], attn.head_dim
        q, k, v = attn.qkv_proj(x).split([attn.num_heads * D, attn.num_kv_heads * D, attn.num_kv_heads * D], dim=-1)
        q = apply_rotary(q.view(T, attn.num_heads, D), cos, sin)
        k = apply_rotary(k.view(T, attn.num_kv_heads, D), cos, sin)
        o = ctx.attention(0, q, k, v.reshape(T, attn.num_kv_heads, D), attn.scale)
        h = residual + attn.out(o)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return (self.norm(h) if self.eagle3 else h), h

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row [N] in the target's vocabulary."""
        if not self.eagle3:
            assert self._target_logits is not None
            return self._target_logits(hidden).argmax(dim=-1)
        best = self.lm_head(hidden).argmax(dim=-1)
        return best + self.d2t[best]
