"""BERT and XLM-RoBERTa (BGE-M3 style) encoders, and their sequence-classification heads
(cross-encoders), from Hugging Face folders: `BertModel`, `BertForSequenceClassification`,
`XLMRobertaModel`, `XLMRobertaForSequenceClassification` (RoBERTa's too).

Post-norm layers: attention (q, k, v and output projections with biases, bidirectional through
`ForwardContext.encoder_attention`), add and LayerNorm, then a dense-act-dense MLP, add and
LayerNorm. Embeddings: word + absolute position + token type (segment ids from
``ctx.token_type_ids``), then LayerNorm. XLM-R numbers positions as transformers does
(`roberta_positions`): a prompt's tokens from ``padding_idx + 1``, counting only the tokens that
are not the padding token, which itself gets ``padding_idx``. The modules carry transformers'
names, so checkpoint tensors load by name (`EncoderModel.load_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from portside.contract import AttentionMetadata, Communicator, ForwardContext, ModelOps
from portside.model.args import ModelArgs
from portside.model.bert_base import EncoderModel, check_whole_prompts, dense_add, hf_activation

__all__ = ["BertModel", "BertForSequenceClassification", "XLMRobertaModel", "XLMRobertaForSequenceClassification"]


class _Linear(nn.Linear):
    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__(n_in, n_out, bias=bias, dtype=dtype)


def roberta_positions(input_ids: torch.Tensor, md: AttentionMetadata, padding_idx: int) -> torch.Tensor:
    """transformers' XLM-R / RoBERTa position ids of the step's prompts (back to back): in each
    prompt, ``padding_idx`` plus the number of non-padding tokens up to and including the token,
    ``padding_idx`` for a padding token."""
    mask = (input_ids != padding_idx).long()
    count = mask.cumsum(0)
    starts = md.query_start_loc.long()
    before = torch.cat([count.new_zeros(1), count]).index_select(0, starts[:-1])  # non-padding tokens of earlier prompts
    count = count - before.repeat_interleave(starts[1:] - starts[:-1], output_size=input_ids.shape[0])
    return count * mask + padding_idx


class BertEmbeddings(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype, padding_idx: int | None) -> None:
        super().__init__()
        if getattr(hf, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise ValueError(f"position_embedding_type {hf.position_embedding_type!r} is not supported (absolute only)")
        self.word_embeddings = nn.Embedding(hf.vocab_size, hf.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(hf.max_position_embeddings, hf.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(hf.type_vocab_size, hf.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hf.hidden_size, eps=hf.layer_norm_eps, dtype=dtype)
        self.padding_idx = padding_idx  # XLM-R / RoBERTa: positions after it (`roberta_positions`)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None,
                md: AttentionMetadata) -> torch.Tensor:
        if self.padding_idx is not None:
            positions = roberta_positions(input_ids, md, self.padding_idx)
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_types is None:
            h = h + self.token_type_embeddings.weight[0]
        else:
            h = h + self.token_type_embeddings(token_types)
        return self.LayerNorm(h)


class _SelfAttention(nn.Module):
    """query, key and value as one [3H, H] linear: checkpoints' ``query``, ``key`` and ``value``
    load into its thirds (`QKV`), so one GEMM projects all three."""

    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.qkv = _Linear(hf.hidden_size, 3 * hf.hidden_size, dtype)


QKV = {f"attention.self.{name}": ("attention.self.qkv", i) for i, name in enumerate(("query", "key", "value"))}


class _Output(nn.Module):
    """dense, then LayerNorm(dense + residual)."""

    def __init__(self, n_in: int, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = _Linear(n_in, hf.hidden_size, dtype)
        self.LayerNorm = nn.LayerNorm(hf.hidden_size, eps=hf.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(dense_add(x, self.dense.weight, self.dense.bias, residual))


class _Attention(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = _SelfAttention(hf, dtype)
        self.output = _Output(hf.hidden_size, hf, dtype)
        self.num_heads = hf.num_attention_heads
        self.head_dim = hf.hidden_size // hf.num_attention_heads

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = (t.view(shape) for t in self.self.qkv(x).chunk(3, dim=1))  # column views, no copy
        o = ctx.encoder_attention(q, k, v, self.head_dim**-0.5)
        return self.output(o.reshape(x.shape[0], -1), x)


class _Intermediate(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = _Linear(hf.hidden_size, hf.intermediate_size, dtype)
        self.act = hf_activation(hf.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (not fused into the linear: oneDNN's GELU post-op made the whole step ~15% slower than
        # torch's GELU after it on the Zen 3 dev VM)
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = _Attention(hf, dtype)
        self.intermediate = _Intermediate(hf, dtype)
        self.output = _Output(hf.intermediate_size, hf, dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        a = self.attention(x, ctx)
        return self.output(self.intermediate(a), a)


class _Encoder(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hf, dtype) for _ in range(hf.num_hidden_layers))


class _Pooler(nn.Module):
    """BERT's pooler: dense + tanh on the first (CLS) token's state."""

    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = _Linear(hf.hidden_size, hf.hidden_size, dtype)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_states))


class BertBody(nn.Module):
    """The encoder stack (transformers' `BertModel` / `XLMRobertaModel` modules, same names)."""

    def __init__(self, hf: Any, dtype: torch.dtype, pooler: bool, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(hf, dtype, padding_idx)
        self.encoder = _Encoder(hf, dtype)
        self.pooler = _Pooler(hf, dtype) if pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return _encode(self.embeddings, self.encoder, input_ids, positions, ctx)


def _encode(embeddings: BertEmbeddings, encoder: _Encoder, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
    check_whole_prompts(ctx.metadata)
    h = embeddings(input_ids, positions, ctx.token_type_ids, ctx.metadata)
    for layer in encoder.layer:
        h = layer(h, ctx)
    return h


def _padding_idx(hf: Any) -> int:
    """XLM-R / RoBERTa: the padding token, whose index its positions start after."""
    return hf.pad_token_id if hf.pad_token_id is not None else 1


class BertModel(EncoderModel):
    """`BertModel`: final hidden states (BERT has no final norm past its last layer's)."""

    checkpoint_prefixes = ("bert.",)
    ignored = ("cls.",)  # BertForPreTraining / MaskedLM heads
    stacked = QKV
    _padding_idx: Callable[[Any], int | None] = staticmethod(lambda hf: None)

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops)
        body = BertBody(self.hf, dtype, pooler=True, padding_idx=self._padding_idx(self.hf))
        # transformers' BertModel names: embeddings., encoder.layer.N., pooler.
        self.embeddings, self.encoder, self.pooler = body.embeddings, body.encoder, body.pooler

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return _encode(self.embeddings, self.encoder, input_ids, positions, ctx)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        # a base model saved without its pooler (sentence-transformers exports) leaves it unused
        loaded = super().load_weights(weights)
        if self.pooler is not None and not any(n.startswith("pooler.") for n in loaded):
            self.pooler = None
        return loaded


class XLMRobertaModel(BertModel):
    """`XLMRobertaModel` (BGE-M3, multilingual-e5) and `RobertaModel`: BERT with positions after
    the padding index and one token type."""

    checkpoint_prefixes = ("roberta.",)
    ignored = ("lm_head.",)
    _padding_idx = staticmethod(_padding_idx)


class BertForSequenceClassification(EncoderModel):
    """BERT cross-encoder: CLS state -> pooler (dense + tanh) -> classifier."""

    stacked = QKV

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops)
        self.num_labels = int(self.hf.num_labels)
        self.bert = BertBody(self.hf, dtype, pooler=True)
        self.classifier = _Linear(self.hf.hidden_size, self.num_labels, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.bert(input_ids, positions, ctx)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] CLS states -> [B, num_labels] logits."""
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(pooled.to(self.dtype)))


class _RobertaClassificationHead(nn.Module):
    def __init__(self, hf: Any, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = _Linear(hf.hidden_size, hf.hidden_size, dtype)
        self.out_proj = _Linear(hf.hidden_size, num_labels, dtype)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_states)))


class XLMRobertaForSequenceClassification(EncoderModel):
    """XLM-R / RoBERTa cross-encoder (bge-reranker): CLS state -> dense + tanh -> out_proj."""

    stacked = QKV

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops)
        self.num_labels = int(self.hf.num_labels)
        self.roberta = BertBody(self.hf, dtype, pooler=False, padding_idx=_padding_idx(self.hf))
        self.classifier = _RobertaClassificationHead(self.hf, self.num_labels, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.roberta(input_ids, positions, ctx)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] CLS states -> [B, num_labels] logits."""
        return self.classifier(pooled.to(self.dtype))
