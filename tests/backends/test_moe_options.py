"""The cpu and Triton mixture-of-experts overrides with the later keyword options (expert biases,
gpt-oss's clamped "swiglu_oai", and through `fused_moe` the grouped / bias-corrected / scaled
routing) against core's reference (`portside.ops.moe`). The Triton cases run under the
interpreter on CPU tensors (marker ``triton``: the triton CI leg)."""

from __future__ import annotations

import pytest
import torch

from portside.backends.cpu.moe import CpuModelOps
from portside.contract import ModelOps
from portside.ops.moe import moe_experts, select_experts
from portside.testing.tolerances import assert_close

HIDDEN, INTER = 48, 40  # not multiples of the kernels' tiles

# (activation, w13_bias?, w2_bias?, swiglu_limit)
OPTIONS = [("silu", True, False, 7.0), ("gelu_tanh", False, True, 7.0), ("silu", True, True, 7.0),
           ("swiglu_oai", True, True, 7.0), ("swiglu_oai", True, True, 0.75), ("swiglu_oai", False, False, 0.75)]  # fmt: skip


def make(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * INTER**-0.5
    b13, b2 = torch.randn(num_experts, 2 * INTER, generator=gen) * 0.3, torch.randn(num_experts, HIDDEN, generator=gen) * 0.3
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return [t.to(dtype) for t in (x, w13, w2, b13, b2)], logits


def check(ops: ModelOps, device: torch.device, num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype,
          activation: str, with_b13: bool, with_b2: bool, limit: float) -> None:  # fmt: skip
    (x, w13, w2, b13, b2), logits = make(num_tokens, num_experts, top_k, dtype, seed=num_tokens + num_experts)
    b13, b2 = (b13 if with_b13 else None), (b2 if with_b2 else None)
    weights, ids = select_experts(logits, top_k, True)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    want = moe_experts(x.float(), w13.float(), w2.float(), weights, ids, activation, w13_bias=f32(b13), w2_bias=f32(b2),
                       swiglu_limit=limit).to(dtype)  # fmt: skip
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = ops.moe_experts(dev(x), dev(w13), dev(w2), dev(weights), dev(ids), activation, w13_bias=dev(b13),
                          w2_bias=dev(b2), swiglu_limit=limit)  # fmt: skip
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got.cpu(), want, dtype)


@pytest.mark.parametrize("activation, with_b13, with_b2, limit", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (21, 8, 2), (37, 16, 4)])
def test_cpu_moe_experts_with_options(num_tokens, num_experts, top_k, dtype, activation, with_b13, with_b2, limit):
    check(CpuModelOps(), torch.device("cpu"), num_tokens, num_experts, top_k, dtype, activation, with_b13, with_b2, limit)


def test_cpu_fused_moe_with_grouped_biased_routing():
    (x, w13, w2, b13, b2), logits = make(13, 16, 4, torch.float32, seed=5)
    options = dict(num_groups=4, topk_groups=2, group_scoring="top2_sum", correction_bias=torch.linspace(-0.2, 0.2, 16),
                   scaling_factor=2.5, w13_bias=b13, w2_bias=b2)  # fmt: skip
    got = CpuModelOps().fused_moe(x, logits, w13, w2, 4, True, "sigmoid", "silu", **options)
    assert_close(got, ModelOps().fused_moe(x, logits, w13, w2, 4, True, "sigmoid", "silu", **options), torch.float32)


@pytest.mark.triton
@pytest.mark.parametrize("activation, with_b13, with_b2, limit", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (21, 8, 2)])
def test_triton_moe_experts_with_options(num_tokens, num_experts, top_k, dtype, activation, with_b13, with_b2, limit,
                                         kernel_device):  # fmt: skip
    pytest.importorskip("triton")
    from portside.backends.triton.moe import TritonModelOps

    check(TritonModelOps(), kernel_device, num_tokens, num_experts, top_k, dtype, activation, with_b13, with_b2, limit)


@pytest.mark.triton
def test_glm4_moe_logits_through_the_triton_experts(tmp_path, kernel_device):
    """A tiny GLM-4.5 (grouped, bias-corrected, scaled routing; shared experts) with its experts in
    the fused Triton kernel: transformers' logits."""
    pytest.importorskip("triton")
    from portside.attention.reference import ReferenceAttentionBackend
    from portside.backends.triton.moe import TritonModelOps
    from portside.config import ModelConfig
    from portside.model.registry import load_model
    from portside.testing.paged import PagedSequence
    from portside.testing.tiny import hf_logits
    from portside.testing.tiny_glm4_moe import make_tiny_glm4_moe

    path = make_tiny_glm4_moe(tmp_path / "glm", n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                              num_hidden_layers=2)  # fmt: skip
    prompt = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45]
    model = load_model(ModelConfig(path=str(path), max_model_len=128), kernel_device, ops=TritonModelOps())
    logits = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(prompt)
    torch.testing.assert_close(logits.cpu(), hf_logits(path, prompt), atol=1e-4, rtol=1e-4)
