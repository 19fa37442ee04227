"""Rotary embedding against transformers: cos/sin (attention factor included) of every rope type and
of partial rotary, the rotation itself, and the parsing of each type from a config."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, PhiConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

from portside.model.args import ModelArgs, RopeScaling
from portside.model.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

TINY = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
HEAD_DIM = 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 1.5 * i for i in range(HEAD_DIM // 2)]
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG}


def llama(**rope: Any) -> LlamaConfig:
    return LlamaConfig(**TINY, max_position_embeddings=4096, rope_parameters={"rope_theta": 10000.0, **rope})


def phi3(**rope: Any) -> Phi3Config:  # Phi-3-mini-128k's shape: the original context 1024, extended 4x
    return Phi3Config(
        **TINY,
        max_position_embeddings=4096,
        original_max_position_embeddings=1024,
        rope_parameters={**LONGROPE, **rope},
    )


def phi(partial: float, **rope: Any) -> PhiConfig:
    return PhiConfig(
        **TINY,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": partial, **rope},
    )


WITHIN = [0, 1, 2, 7, 100, 513, 1023]  # positions within the original context
BEYOND = [*WITHIN, 2000, 4095]  # and past it: transformers' longrope then uses the long factors

# id: (config, transformers' rotary class, positions, engine context length, attention factor != 1)
CASES: dict[str, tuple[Callable[[], Any], type, list[int], int | None, bool]] = {
    "default": (lambda: llama(rope_type="default"), LlamaRotaryEmbedding, BEYOND, None, False),
    "linear": (lambda: llama(rope_type="linear", factor=4.0), LlamaRotaryEmbedding, BEYOND, None, False),
    "dynamic-within-trained-context": (lambda: llama(rope_type="dynamic", factor=2.0), LlamaRotaryEmbedding, BEYOND, 4096, False),
    "llama3": (
        lambda: llama(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
        LlamaRotaryEmbedding, BEYOND, None, False,
    ),
    "yarn": (lambda: llama(**YARN), LlamaRotaryEmbedding, BEYOND, None, True),
    "yarn-mscale": (lambda: llama(**YARN, mscale=0.707, mscale_all_dim=0.5), LlamaRotaryEmbedding, BEYOND, None, True),
    "yarn-mscale-equal": (lambda: llama(**YARN, mscale=1.0, mscale_all_dim=1.0), LlamaRotaryEmbedding, BEYOND, None, False),
    "yarn-no-truncate-betas": (
        lambda: llama(**YARN, truncate=False, beta_fast=16, beta_slow=2), LlamaRotaryEmbedding, BEYOND, None, True,
    ),
    "yarn-attention-factor": (lambda: llama(**YARN, attention_factor=0.8), LlamaRotaryEmbedding, BEYOND, None, True),
    "longrope-short": (phi3, Phi3RotaryEmbedding, WITHIN, 1024, True),
    "longrope-long": (phi3, Phi3RotaryEmbedding, BEYOND, 4096, True),
    "longrope-factor-attention-factor": (
        lambda: phi3(factor=8.0, attention_factor=1.25), Phi3RotaryEmbedding, BEYOND, 4096, True,
    ),
    "partial-0.5": (lambda: phi(0.5), PhiRotaryEmbedding, BEYOND, None, False),
    "partial-0.75": (lambda: phi(0.75), PhiRotaryEmbedding, BEYOND, None, False),
    "partial-0.5-yarn": (lambda: phi(0.5, **YARN), PhiRotaryEmbedding, BEYOND, None, True),
    "partial-0.75-yarn": (lambda: phi(0.75, **YARN, mscale=0.707, mscale_all_dim=0.5), PhiRotaryEmbedding, BEYOND, None, True),
}  # fmt: skip


def portside_rotary(cfg: Any, max_model_len: int | None = None) -> RotaryEmbedding:
    args = ModelArgs.from_hf(cfg, max_model_len=max_model_len)
    rotary_dim = int(args.head_dim * args.partial_rotary_factor)
    return RotaryEmbedding(
        args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, args.max_model_len, rotary_dim
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_cos_sin_equal_transformers(case: str) -> None:
    make_config, hf_class, positions, max_model_len, scaled = CASES[case]
    cfg = make_config()
    pos = torch.tensor(positions)
    cos, sin = portside_rotary(cfg, max_model_len)(pos, torch.float32)
    hf = hf_class(cfg)
    hf_cos, hf_sin = (t[0] for t in hf(torch.zeros(1), pos[None]))  # [T, R]: the angles twice
    assert (hf.attention_scaling != 1.0) == scaled
    half = int(HEAD_DIM * cfg.rope_parameters.get("partial_rotary_factor", 1.0)) // 2
    assert cos.shape == sin.shape == (len(positions), half) and hf_cos.shape == (len(positions), 2 * half)
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        torch.testing.assert_close(theirs[:, half:], theirs[:, :half], rtol=0, atol=0)
        torch.testing.assert_close(ours, theirs[:, :half], rtol=0, atol=0)


def test_longrope_picks_its_factors_by_the_engine_context_length() -> None:
    """Long factors for every position once the context length (max_model_len, else
    max_position_embeddings) exceeds original_max_position_embeddings; short ones otherwise."""
    cfg = phi3()
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"))
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=1025)
    scaling = ModelArgs.from_hf(cfg).rope_scaling
    for max_model_len, expected in ((None, long), (4096, long), (1025, long), (1024, short), (512, short)):
        torch.testing.assert_close(
            rope_inv_freq(HEAD_DIM, 10000.0, scaling, 4096, max_model_len), expected, rtol=0, atol=0
        )


@pytest.mark.parametrize("rotary_dim", [16, 12, 8])
def test_apply_rotary_equals_transformers(rotary_dim: int) -> None:
    """The first rotary_dim dims rotated in the rotate-half layout of those dims, the rest untouched."""
    gen = torch.Generator().manual_seed(rotary_dim)
    T, H = 5, 3
    q = torch.randn(T, H, HEAD_DIM, generator=gen)
    angles = torch.rand(T, rotary_dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    ours = apply_rotary(q, cos, sin)
    hf_cos, hf_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # [1, T, R]
    theirs, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(ours, theirs[0].transpose(0, 1), rtol=0, atol=0)
    assert torch.equal(ours[..., rotary_dim:], q[..., rotary_dim:])


# ---- parsing ---------------------------------------------------------------------------------


def namespace(**kw: Any) -> SimpleNamespace:
    """A transformers 4.x-style config: rope_theta and rope_scaling as plain attributes."""
    return SimpleNamespace(
        **{**TINY, "num_key_value_heads": 4, "max_position_embeddings": 4096, "rope_theta": 500.0, **kw}
    )


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (llama(rope_type="default"), None),
        (llama(rope_type="linear", factor=4.0), RopeScaling("linear", factor=4.0)),
        (llama(rope_type="dynamic", factor=2.0), RopeScaling("dynamic", factor=2.0)),
        (
            llama(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0, original_max_position_embeddings=64),
            RopeScaling("llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0, original_max_position_embeddings=64),
        ),
        (llama(**YARN), RopeScaling("yarn", factor=4.0, original_max_position_embeddings=1024)),
        (
            llama(**YARN, mscale=0.707, mscale_all_dim=0.5, truncate=False, beta_fast=16, beta_slow=2, attention_factor=0.8),
            RopeScaling(
                "yarn", factor=4.0, original_max_position_embeddings=1024, attention_factor=0.8, beta_fast=16.0,
                beta_slow=2.0, mscale=0.707, mscale_all_dim=0.5, truncate=False,
            ),
        ),
        (llama(rope_type="yarn", factor=None, original_max_position_embeddings=1024), RopeScaling("yarn", factor=4.0, original_max_position_embeddings=1024)),
        # no factor: the ratio of the contexts (Phi-3); the top-level original context wins (as in transformers)
        (phi3(), RopeScaling("longrope", factor=4.0, original_max_position_embeddings=1024, short_factor=tuple(SHORT), long_factor=tuple(LONG))),
        (
            phi3(factor=8.0, attention_factor=1.25),
            RopeScaling("longrope", factor=8.0, original_max_position_embeddings=1024, attention_factor=1.25, short_factor=tuple(SHORT), long_factor=tuple(LONG)),
        ),
        # transformers 4.x spellings
        (namespace(rope_scaling={"type": "linear", "factor": 2.0}), RopeScaling("linear", factor=2.0)),
        (
            namespace(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64),
        ),
        (
            namespace(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 0.5}),
            RopeScaling("yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=0.5),
        ),
        (
            namespace(original_max_position_embeddings=1024, rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG}),
            RopeScaling("longrope", factor=4.0, original_max_position_embeddings=1024, short_factor=tuple(SHORT), long_factor=tuple(LONG)),
        ),
    ],
    ids=lambda v: getattr(v, "rope_type", None) if isinstance(v, RopeScaling) else None,
)  # fmt: skip
def test_each_rope_type_is_parsed(cfg: Any, expected: RopeScaling | None) -> None:
    args = ModelArgs.from_hf(cfg)
    assert args.rope_scaling == expected
    assert args.rope_theta == (500.0 if isinstance(cfg, SimpleNamespace) else 10000.0)


def test_transformers4_phi3_su_config_equals_transformers() -> None:
    """Phi-3's old spelling ("su", read as is) against transformers' longrope of the same config.
    (transformers 5 renames "su" to "longrope" itself, but only after its validation, which then
    misses original_max_position_embeddings: the reference is built with the new name.)"""
    old = {"rope_theta": 500.0, "original_max_position_embeddings": 1024}
    su = {"type": "su", "short_factor": SHORT, "long_factor": LONG}
    cfg = Phi3Config(**TINY, max_position_embeddings=4096, **old, rope_scaling={**su, "type": "longrope"})
    pos = torch.tensor(BEYOND)
    cos, sin = portside_rotary(namespace(**old, rope_scaling=su))(pos, torch.float32)
    hf_cos, hf_sin = (t[0, :, : HEAD_DIM // 2] for t in Phi3RotaryEmbedding(cfg)(torch.zeros(1), pos[None]))
    torch.testing.assert_close((cos, sin), (hf_cos, hf_sin), rtol=0, atol=0)


@pytest.mark.parametrize("rope_type", ["proportional", "mrope", "bogus"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    with pytest.raises(ValueError, match=f"'{rope_type}'.*default, linear, dynamic, llama3, yarn, longrope"):
        ModelArgs.from_hf(namespace(rope_scaling={"type": rope_type, "factor": 2.0}))
    with pytest.raises(ValueError, match=f"'{rope_type}'.*default, linear, dynamic, llama3, yarn, longrope"):
        rope_inv_freq(HEAD_DIM, 10000.0, RopeScaling(rope_type), 4096)
