"""Triton fused MoE vs core's reference (`portside.ops.moe.moe_experts`).

Under the interpreter on CPU tensors (conftest sets TRITON_INTERPRET), so sizes are small: 2 and
8 experts, top-1 and top-2, T = 1 and 21, an expert no token picks, fp32 and bf16, both
activations; and the alignment's invariants checked exactly.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import ModelOps
from portside.ops.moe import moe_experts, select_experts

triton = pytest.importorskip("triton")

from portside.backends.triton.launch import ArchInfo, MoeLaunch, choose_moe_launch  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.moe import TritonModelOps, align_pairs, fused_experts  # noqa: E402

pytestmark = pytest.mark.triton

HIDDEN, INTER = 48, 40  # not multiples of the 32-wide tiles: the masks are exercised


def make_moe(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Inputs of one MoE layer, routed by core's `select_experts`; the last expert gets no token
    unless every token needs every expert."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * INTER**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if top_k < num_experts:
        logits[:, -1] = -1e9  # never picked
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    to = lambda t: t.to(device)  # noqa: E731
    return to(x.to(dtype)), to(w13.to(dtype)), to(w2.to(dtype)), to(weights), to(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 21])
@pytest.mark.parametrize("num_experts,top_k", [(2, 1), (2, 2), (8, 1), (8, 2)])
def test_fused_experts_matches_reference(num_experts: int, top_k: int, num_tokens: int, dtype: torch.dtype, kernel_device) -> None:
    x, w13, w2, weights, ids = make_moe(num_tokens, num_experts, top_k, dtype, kernel_device, seed=num_tokens + num_experts)
    assert top_k == num_experts or not (ids == num_experts - 1).any()
    out = TritonModelOps().moe_experts(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    expected = moe_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert_close(out.cpu(), expected)


@pytest.mark.parametrize("block_m,activation", [(16, "gelu_tanh"), (64, "silu")])
def test_tile_sizes_and_gelu(block_m: int, activation: str, kernel_device) -> None:
    # 21 pairs per expert: two 16-row blocks each (the second mostly padding), or one 64-row one.
    x, w13, w2, weights, ids = make_moe(21, 2, 2, torch.float32, kernel_device, seed=3)
    launch = MoeLaunch(block_m, 32, 32, 4, 1, "ieee", upcast=True)
    out = fused_experts(x, w13, w2, weights, ids, activation, launch)
    assert_close(out.cpu(), moe_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(), activation))


def test_launch_tiles_follow_pairs_per_expert() -> None:
    arch = ArchInfo(vendor="nvidia", num_sms=132, capability=(9, 0))
    decode = choose_moe_launch(arch, 8, 64, torch.bfloat16)  # 8 tokens x top-1 over 64 experts
    assert decode.block_m == 16 and decode.input_precision == "tf32" and not decode.upcast
    assert choose_moe_launch(arch, 8192 * 8, 64, torch.bfloat16).block_m == 64
    assert choose_moe_launch(arch, 8, 64, torch.float32).input_precision == "ieee"


def test_fused_moe_routes_then_computes(kernel_device) -> None:
    x, w13, w2, _, _ = make_moe(5, 8, 2, torch.float32, kernel_device, seed=4)
    logits = torch.randn(5, 8, device=kernel_device)
    out = TritonModelOps().fused_moe(x, logits, w13, w2, top_k=2, renormalize=True)
    assert_close(out.cpu(), ModelOps().fused_moe(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), top_k=2, renormalize=True))


def test_cuda_and_rocm_platforms_use_the_triton_kernel() -> None:
    from portside.backends.cuda.platform import CudaPlatform
    from portside.backends.rocm.platform import RocmPlatform
    from portside.config import EngineConfig, ModelConfig

    config = EngineConfig(model=ModelConfig(path="unused"))
    assert isinstance(CudaPlatform.model_ops(config), TritonModelOps)
    assert isinstance(RocmPlatform.model_ops(config), TritonModelOps)


def test_unknown_activation_is_refused() -> None:
    x, w13, w2, weights, ids = make_moe(1, 2, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="relu"):
        fused_experts(x, w13, w2, weights, ids, "relu")


def test_align_pairs_groups_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])  # expert 4 of 5 has no pair
    sorted_pairs, block_experts, num_rows = align_pairs(ids, num_experts=5, block_m=2)
    flat = ids.flatten()
    num_pairs = flat.numel()
    assert sorted_pairs.shape[0] == num_pairs + 5 * (2 - 1) + 1  # rounded up to whole blocks
    assert num_rows.item() == 2 + 2 + 2 + 4  # experts 0, 1, 2, 3: 2, 1, 1, 4 pairs padded to 2
    used = sorted_pairs[: num_rows.item()].view(-1, 2)
    for block, expert in zip(used.tolist(), block_experts.tolist()):
        real = [p for p in block if p < num_pairs]
        assert real and all(flat[p] == expert for p in real)  # no empty block, one expert each
    assert sorted(p for p in sorted_pairs.tolist() if p < num_pairs) == list(range(num_pairs))
    assert (sorted_pairs[num_rows.item() :] == num_pairs).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_moe_experts_replays_in_a_cuda_graph(kernel_device) -> None:
    """No host sync anywhere in `moe_experts` (capture would fail), and a replay follows new
    routing written into the captured buffers."""
    x, w13, w2, weights, ids = make_moe(9, 8, 2, torch.bfloat16, kernel_device, seed=7)
    ops = TritonModelOps()
    ops.moe_experts(x, w13, w2, weights, ids)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = make_moe(9, 8, 2, torch.bfloat16, kernel_device, seed=8)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    assert_close(out.cpu(), moe_experts(x2.cpu(), w13.cpu(), w2.cpu(), weights2.cpu(), ids2.cpu()))
