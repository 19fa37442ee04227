"""Mixture-of-experts routing variants and expert options of core's reference
(`portside.ops.moe`, `ModelOps`) against transformers' own routers and experts:

- DeepSeek-V2's ``greedy`` and ``group_limited_greedy`` (softmax; groups scored by their best
  expert; routed_scaling_factor), DeepSeek-V3's and GLM-4.5's ``noaux_tc`` (sigmoid; choice by
  score + e_score_correction_bias; groups scored by their two best; norm_topk_prob;
  routed_scaling_factor), on 4 to 16 experts with groups and top-k varied, and on logits with
  ties (whole groups and single experts duplicated): the transformers module is driven with an
  identity router weight, so its router logits are exactly the test's;
- gpt-oss's experts (biases, clamped SwiGLU with alpha and limit; gate and up interleaved in its
  layout) against `GptOssExperts`, and its router (softmax over the top-k logits) as softmax
  scoring renormalised;
- an override written before the options existed (`ModelOps.__init_subclass__`): called as
  written without them, the reference with them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.contract import ModelOps
from portside.ops.moe import moe_experts, select_experts

transformers = pytest.importorskip("transformers")


def _identity_router(router: torch.nn.Module, experts: int) -> torch.nn.Module:
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    return router


def hf_deepseek_v2_route(logits, top_k, method, groups, topk_groups, factor):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Config, DeepseekV2TopkRouter

    e = logits.shape[1]
    cfg = DeepseekV2Config(hidden_size=e, n_routed_experts=e, num_experts_per_tok=top_k, topk_method=method,
                           n_group=groups, topk_group=topk_groups, routed_scaling_factor=factor,
                           num_attention_heads=1)  # fmt: skip
    _, weights, ids = _identity_router(DeepseekV2TopkRouter(cfg), e)(logits)
    return weights, ids


def hf_noaux_tc_route(model_type, logits, bias, top_k, groups, topk_groups, norm, factor):
    if model_type == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
    e = logits.shape[1]
    cfg = Config(hidden_size=e, n_routed_experts=e, num_experts_per_tok=top_k, n_group=groups, topk_group=topk_groups,
                 norm_topk_prob=norm, routed_scaling_factor=factor, num_attention_heads=1)  # fmt: skip
    router = _identity_router(Router(cfg), e)
    router.e_score_correction_bias.copy_(bias)
    _, weights, ids = router(logits)
    return weights, ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (ids, weights) ordered by expert id (transformers' top-k is unsorted)."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def assert_same_route(got, want, choice=None):
    """Same experts and weights per token; where `choice` [T, E] (the scores experts were chosen
    by) has ties at the boundary, the chosen sets may differ between equally good experts: then
    compare the sorted choice scores and sorted weights instead."""
    (gi, gw), (wi, ww) = by_expert(*got), by_expert(*want)
    if choice is None:
        assert torch.equal(gi, wi)
        torch.testing.assert_close(gw, ww.float(), rtol=1e-6, atol=1e-7)
        return
    for t in range(gi.shape[0]):
        if torch.equal(gi[t], wi[t]):
            torch.testing.assert_close(gw[t], ww[t].float(), rtol=1e-6, atol=1e-7)
        else:  # a tie broken the other way: equally good picks
            torch.testing.assert_close(choice[t, gi[t]].sort().values, choice[t, wi[t]].sort().values)
            torch.testing.assert_close(gw[t].sort().values, ww[t].float().sort().values, rtol=1e-6, atol=1e-7)


# (experts, top_k, groups, topk_groups)
GROUPED = [(4, 1, 2, 1), (4, 2, 2, 1), (8, 2, 4, 2), (8, 3, 2, 2), (12, 4, 3, 2), (16, 4, 4, 2), (16, 6, 8, 3),
           (16, 8, 4, 4), (16, 1, 16, 1)]  # fmt: skip


def _logits(t: int, e: int, seed: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=gen)
    if ties:  # duplicated groups of two, and coarse values: ties between groups and within them
        logits = (logits * 2).round() / 2
        logits[: t // 2, e - e // 2 :] = logits[: t // 2, : e // 2]
    return logits


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("experts, top_k, groups, topk_groups", GROUPED)
def test_deepseek_v2_routing_matches_transformers(experts, top_k, groups, topk_groups, ties):
    logits = _logits(7, experts, experts * 31 + top_k, ties)
    for method in ("greedy", "group_limited_greedy"):
        factor = 1.0 if method == "greedy" else 2.5
        want = hf_deepseek_v2_route(logits, top_k, method, groups, topk_groups, factor)
        options = dict(num_groups=groups, topk_groups=topk_groups, group_scoring="max") if method != "greedy" else {}
        got = select_experts(logits, top_k, False, "softmax", scaling_factor=factor, **options)
        assert_same_route(got, want, torch.softmax(logits, -1) if ties else None)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("experts, top_k, groups, topk_groups", [g for g in GROUPED if g[0] // g[2] >= 2])
def test_noaux_tc_routing_matches_transformers(model_type, experts, top_k, groups, topk_groups, ties):
    logits = _logits(9, experts, experts * 17 + groups, ties)
    gen = torch.Generator().manual_seed(experts + top_k)
    bias = torch.zeros(experts) if ties else torch.randn(experts, generator=gen) * 0.1
    for norm, factor in ((True, 2.5), (False, 1.0), (True, 1.0)):
        want = hf_noaux_tc_route(model_type, logits, bias, top_k, groups, topk_groups, norm, factor)
        got = select_experts(logits, top_k, norm, "sigmoid", num_groups=groups, topk_groups=topk_groups,
                             group_scoring="top2_sum", correction_bias=bias, scaling_factor=factor)  # fmt: skip
        assert_same_route(got, want, torch.sigmoid(logits) + bias if ties else None)


@st.composite
def grouped_routing(draw):
    """A routing of 4 to 16 experts: groups dividing them, the kept groups, a top-k they can hold."""
    experts = draw(st.integers(4, 16))
    groups = draw(st.sampled_from([g for g in range(1, experts + 1) if experts % g == 0 and experts // g >= 2]))
    topk_groups = draw(st.integers(1, groups))
    top_k = draw(st.integers(1, topk_groups * (experts // groups)))
    return experts, groups, topk_groups, top_k, draw(st.integers(0, 2**16)), draw(st.booleans())


@settings(max_examples=60, deadline=None, derandomize=True)  # reproducible in CI
@given(routing=grouped_routing())
def test_any_grouped_routing_matches_transformers(routing):
    """V3's noaux_tc and V2's group_limited_greedy on random shapes (and coarse logits with ties)."""
    experts, groups, topk_groups, top_k, seed, ties = routing
    logits = _logits(5, experts, seed, ties)
    bias = torch.zeros(experts) if ties else torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * 0.1
    want = hf_noaux_tc_route("deepseek_v3", logits, bias, top_k, groups, topk_groups, True, 2.5)
    got = select_experts(logits, top_k, True, "sigmoid", num_groups=groups, topk_groups=topk_groups,
                         group_scoring="top2_sum", correction_bias=bias, scaling_factor=2.5)  # fmt: skip
    assert_same_route(got, want, torch.sigmoid(logits) + bias if ties else None)
    want = hf_deepseek_v2_route(logits, top_k, "group_limited_greedy", groups, topk_groups, 1.0)
    got = select_experts(logits, top_k, False, "softmax", num_groups=groups, topk_groups=topk_groups)
    assert_same_route(got, want, torch.softmax(logits, -1) if ties else None)


def test_chosen_by_biased_score_weighted_by_unbiased():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 wins the choice, keeps its own score
    weights, ids = select_experts(logits, 2, False, "sigmoid", correction_bias=bias)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


def test_grouping_refuses_impossible_configs():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="equal groups"):
        select_experts(logits, 2, False, num_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match="at least top_k"):
        select_experts(logits, 5, False, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="2 or more experts per group"):
        select_experts(logits, 2, False, num_groups=8, topk_groups=4, group_scoring="top2_sum")
    with pytest.raises(ValueError, match="group scoring"):
        select_experts(logits, 2, False, num_groups=4, topk_groups=2, group_scoring="mean")


def test_gpt_oss_router_is_softmax_renormalised():
    """gpt-oss: softmax over the top-k logits (with the router's bias) == top-k of the softmax,
    renormalised."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=8, num_local_experts=8, num_experts_per_tok=3, num_attention_heads=1)
    router = GptOssTopKRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 8, generator=gen))
        router.bias.copy_(torch.randn(8, generator=gen))
    x = torch.randn(11, 8, generator=gen)
    logits, weights, ids = router(x)
    assert_same_route(select_experts(logits, 3, True), (weights, ids))


@pytest.mark.parametrize("limit", [7.0, 0.6])
@pytest.mark.parametrize("experts, top_k", [(4, 2), (8, 4)])
def test_gpt_oss_experts_match_transformers(experts, top_k, limit):
    """`moe_experts` with biases and "swiglu_oai" equals `GptOssExperts` (whose gate_up_proj is
    [E, hidden, 2I] with gate and up interleaved: re-laid as w13 [E, 2I, hidden], gate rows first)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts

    hidden, inter = 16, 12
    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, swiglu_limit=limit,
                       num_attention_heads=1)  # fmt: skip
    hf = GptOssExperts(cfg)
    gen = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(9, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(9, experts, generator=gen), top_k, True)
    want = hf(x, ids, weights)
    gate_up, b13 = hf.gate_up_proj.detach(), hf.gate_up_proj_bias.detach()
    w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)  # [E, 2I, hidden]
    w13_bias = torch.cat([b13[:, ::2], b13[:, 1::2]], dim=-1)
    w2 = hf.down_proj.detach().transpose(1, 2)  # [E, hidden, I]
    got = moe_experts(x, w13, w2, weights, ids, "swiglu_oai", w13_bias=w13_bias, w2_bias=hf.down_proj_bias.detach(),
                      swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=limit)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class OldStyleOps(ModelOps):
    """A plugin's overrides written before the keyword options."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def select_experts(self, router_logits, top_k, renormalize, scoring="softmax"):
        self.calls.append("select_experts")
        return super().select_experts(router_logits, top_k, renormalize, scoring)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, activation="silu"):
        self.calls.append("moe_experts")
        return super().moe_experts(x, w13, w2, topk_weights, topk_ids, activation)


def _moe_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x, logits = torch.randn(5, 16, generator=gen), torch.randn(5, 8, generator=gen)
    w13, w2 = torch.randn(8, 24, 16, generator=gen) * 0.25, torch.randn(8, 16, 12, generator=gen) * 0.3
    return x, logits, w13, w2, torch.randn(8, 24, generator=gen), torch.randn(8, 16, generator=gen)


def test_old_style_override_runs_as_written_without_the_options():
    ops, (x, logits, w13, w2, _, _) = OldStyleOps(), _moe_inputs()
    got = ops.fused_moe(x, logits, w13, w2, 2, True, "softmax", "gelu_tanh")
    assert ops.calls == ["select_experts", "moe_experts"]
    torch.testing.assert_close(got, ModelOps().fused_moe(x, logits, w13, w2, 2, True, "softmax", "gelu_tanh"))


@pytest.mark.parametrize("option", ["bias", "swiglu_oai", "groups", "correction_bias", "scaling"])
def test_old_style_override_falls_back_to_the_reference_with_an_option(option):
    ops, (x, logits, w13, w2, b13, b2) = OldStyleOps(), _moe_inputs(1)
    kwargs = {
        "bias": dict(w13_bias=b13, w2_bias=b2),
        "swiglu_oai": dict(activation="swiglu_oai", swiglu_limit=0.5),
        "groups": dict(num_groups=4, topk_groups=1),
        "correction_bias": dict(scoring="sigmoid", correction_bias=torch.linspace(0, 1, 8)),
        "scaling": dict(scaling_factor=2.5),
    }[option]
    got = ops.fused_moe(x, logits, w13, w2, 2, True, **kwargs)
    want = ModelOps().fused_moe(x, logits, w13, w2, 2, True, **kwargs)
    torch.testing.assert_close(got, want)
    routed = option in ("groups", "correction_bias", "scaling")
    assert ops.calls == (["moe_experts"] if routed else ["select_experts"])  # the other ran as written
    assert not torch.allclose(got, ModelOps().fused_moe(x, logits, w13, w2, 2, True))  # the option did something


# ---- the DeepseekMoE block (core/model/deepseek_moe.py) against transformers' MoE modules -----

# (model type, config overrides): routing variants over 4 to 16 experts
BLOCKS = [
    ("deepseek_v2", dict(n_routed_experts=4, num_experts_per_tok=2, topk_method="greedy", n_shared_experts=1,
                         routed_scaling_factor=1.0)),
    ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, n_shared_experts=2, routed_scaling_factor=16.0)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                         norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                         norm_topk_prob=False, routed_scaling_factor=1.0)),
    ("glm4_moe", dict(n_routed_experts=12, num_experts_per_tok=4, n_group=3, topk_group=2, n_shared_experts=1,
                      norm_topk_prob=True, routed_scaling_factor=1.5)),
    ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=2,
                      norm_topk_prob=True, routed_scaling_factor=2.5)),
]  # fmt: skip


def hf_moe_block(model_type: str, overrides: dict, seed: int):
    """transformers' MoE module for a tiny config (hidden 32, moe_intermediate 16), random weights
    (and correction bias), with the checkpoint names its `state_dict` has under ``mlp.``."""
    from transformers import AutoConfig

    mod = {"deepseek_v2": ("deepseek_v2", "DeepseekV2Moe"), "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE"),
           "glm4_moe": ("glm4_moe", "Glm4MoeMoE")}[model_type]  # fmt: skip
    module = __import__(f"transformers.models.{mod[0]}.modeling_{mod[0]}", fromlist=[mod[1]])
    cfg = AutoConfig.for_model(model_type, hidden_size=32, moe_intermediate_size=16, intermediate_size=48,
                               num_attention_heads=4, **overrides)  # fmt: skip
    block = getattr(module, mod[1])(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            scale = 0.1 if "correction_bias" in name else 0.3
            t.copy_(torch.randn(t.shape, generator=gen) * scale)
    return cfg, block


def load_block(ours: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
    """Load transformers' ``mlp.*`` tensors into a DeepseekMoE through the decoder's name mapping."""
    from types import SimpleNamespace

    from portside.model.decoder import DecoderForCausalLM

    params = dict(ours.named_parameters())
    mapper = SimpleNamespace(renames=())
    for name, tensor in hf_state.items():
        for target, shard, part in DecoderForCausalLM.checkpoint_tensors(mapper, "mlp." + name, tensor):  # type: ignore[arg-type]
            param = params[target.removeprefix("mlp.")]
            param.weight_loader(param, part, shard)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type, overrides", BLOCKS)
def test_deepseek_moe_block_matches_transformers(model_type, overrides, dtype):
    from portside.contract import SingleRankCommunicator
    from portside.model.deepseek_moe import DeepseekMoE

    cfg, hf = hf_moe_block(model_type, overrides, seed=len(BLOCKS) + overrides["n_routed_experts"])
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ours = DeepseekMoE(cfg, ModelOps(), SingleRankCommunicator(), 0, 1, dtype)
    load_block(ours, hf_state)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(1))
    if dtype == torch.bfloat16:  # transformers keeps the router (gate.weight, its bias) in fp32
        hf = hf.to(dtype)
        hf.gate.weight.data = hf_state["gate.weight"]
        if hasattr(hf.gate, "e_score_correction_bias"):
            hf.gate.e_score_correction_bias.data = hf_state["gate.e_score_correction_bias"]
    with torch.no_grad():
        want = hf(x.to(dtype))
        got = ours(x.to(dtype))
    assert got.dtype == dtype
    # bf16: transformers sums the experts in bf16, portside in fp32: an error of the output's scale
    scale = float(want.float().abs().max())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("model_type, overrides", [BLOCKS[1], BLOCKS[4]])
def test_deepseek_moe_block_tensor_parallel(model_type, overrides):
    """Two ranks (threads): each a slice of every routed and shared expert, one all-reduce: the
    single-rank output."""
    import sys
    from pathlib import Path

    from portside.model.deepseek_moe import DeepseekMoE

    sys.path.insert(0, str(Path(__file__).parent))
    from test_models import run_ranks

    cfg, hf = hf_moe_block(model_type, overrides, seed=3)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    calls: list[int] = []

    def rank(comm, r):
        ours = DeepseekMoE(cfg, ModelOps(), comm, r, 2, torch.float32)
        load_block(ours, hf_state)
        assert ours.experts.w13.shape[1] == 16 and ours.shared_experts.down_proj.weight.shape[1] == 8 * overrides["n_shared_experts"]
        reduce = comm.all_reduce

        def counted(t):
            calls.append(r)
            return reduce(t)

        comm.all_reduce = counted
        with torch.no_grad():
            return ours(x)

    outs = run_ranks(2, rank)
    with torch.no_grad():
        want = hf(x)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert sorted(calls) == [0, 1]  # one all-reduce per rank


def test_routing_options_from_configs():
    from transformers import AutoConfig

    from portside.model.deepseek_moe import routing_options

    v2 = AutoConfig.for_model("deepseek_v2", topk_method="group_limited_greedy", n_group=8, topk_group=3,
                              routed_scaling_factor=16.0)  # fmt: skip
    assert routing_options(v2) == dict(renormalize=False, scoring="softmax", scaling_factor=16.0, num_groups=8,
                                       topk_groups=3, group_scoring="max")  # fmt: skip
    v3 = AutoConfig.for_model("deepseek_v3", n_group=8, topk_group=4, routed_scaling_factor=2.5)
    assert routing_options(v3) == dict(renormalize=True, scoring="sigmoid", scaling_factor=2.5, num_groups=8,
                                       topk_groups=4, group_scoring="top2_sum")  # fmt: skip
    assert routing_options(AutoConfig.for_model("deepseek_v2"))["scoring"] == "softmax"
    with pytest.raises(ValueError, match="topk_method 'random'"):
        routing_options(AutoConfig.for_model("deepseek_v2", topk_method="random"))
