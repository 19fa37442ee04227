"""The Triton varlen encoder-attention kernel (`backends/triton/encoder_attention.py`) against
core's reference, `portside.attention.reference.encoder_attention`.

Without a GPU it runs in the Triton interpreter on CPU tensors (conftest sets TRITON_INTERPRET).
Shapes: head sizes 32, 64 and 80 (padded to 128), sequences of lengths 1, 7, 16, 64 and 100
packed in mixed order, fp32/fp16/bf16; forced 16 x 16 tiles (many query blocks and key steps
per sequence, a row tile ending inside the sequence); q, k, v as strided views of a fused qkv
projection; empty sequences and an empty batch; local windows (ModernBERT) of 0, 3, 5, 20 and 200;
the launch heuristics.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.attention.reference import encoder_attention as reference

triton = pytest.importorskip("triton")

from portside.backends.triton.attention import TritonAttentionBackend  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.encoder_attention import (  # noqa: E402
    EncoderLaunch,
    choose_encoder_launch,
    encoder_attention,
)
from portside.backends.triton.launch import ArchInfo  # noqa: E402

pytestmark = pytest.mark.triton

MIXED = (7, 100, 1, 64, 16)


def _inputs(lengths, heads, d, dtype, device, seed=0, fused=False):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    cu = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    packed = torch.randn(t, 3, heads, d, generator=gen).to(dtype)
    q, k, v = packed[:, 0], packed[:, 1], packed[:, 2]
    if not fused:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dev = packed.to(device)
    qd, kd, vd = dev[:, 0], dev[:, 1], dev[:, 2]
    if not fused:
        qd, kd, vd = qd.contiguous(), kd.contiguous(), vd.contiguous()
    return (q, k, v, cu), (qd, kd, vd, cu.to(device))


def _check(lengths, heads, d, dtype, device, launch=None, fused=False, seed=0, window=None):
    (q, k, v, cu), (qd, kd, vd, cud) = _inputs(lengths, heads, d, dtype, device, seed, fused)
    scale = d**-0.5
    out = encoder_attention(qd, kd, vd, cud, max(lengths, default=0), scale, launch, sliding_window=window)
    want = reference(q.float(), k.float(), v.float(), cu, max(lengths, default=0), scale, sliding_window=window).to(dtype)
    assert out.shape == q.shape and out.dtype == dtype and out.device == qd.device
    assert_close(out.cpu(), want, context=f"lengths {list(lengths)}, {heads} heads of {d}, {dtype}, {launch}, window {window}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [32, 64, 80])
def test_encoder_mixed_lengths_match_reference(kernel_device, head_size, dtype):
    _check(MIXED, 2, head_size, dtype, kernel_device, seed=head_size)


@pytest.mark.parametrize("lengths", [(1,), (16,), (100,), (16, 16, 16, 16, 9)], ids=lambda x: "-".join(map(str, x)))
def test_encoder_single_and_window_sequences(kernel_device, lengths):
    _check(lengths, 2, 64, torch.float32, kernel_device, seed=len(lengths))


def test_encoder_small_tiles_many_blocks(kernel_device):
    """16-row, 16-key tiles: sequences span several query blocks and key steps, and blocks
    start in the middle of a tile of the packed rows."""
    _check(MIXED, 2, 80, torch.float32, kernel_device, EncoderLaunch(16, 16, 4, 1, "ieee"), seed=3)


def test_encoder_fused_qkv_views(kernel_device):
    """q, k, v as strided views of one [T, 3, H, D] projection, as a model's qkv split gives them."""
    _check(MIXED, 2, 64, torch.bfloat16, kernel_device, fused=True, seed=5)


@pytest.mark.parametrize("window", [0, 3, 20, 200])
def test_encoder_local_window(kernel_device, window):
    """ModernBERT's local layers: 16 x 16 tiles, so a block's rows see only some key steps, and
    some steps of a row's loop hold none of its keys (window 0, 3); 200 covers every sequence."""
    _check(MIXED, 2, 64, torch.float32, kernel_device, EncoderLaunch(16, 16, 4, 1, "ieee"), seed=window, window=window)


def test_encoder_local_window_default_tiles(kernel_device):
    _check(MIXED, 2, 80, torch.bfloat16, kernel_device, seed=8, window=5)
    (q, k, v, cu), (qd, kd, vd, cud) = _inputs((3, 33), 4, 64, torch.float32, kernel_device, seed=2)
    backend = TritonAttentionBackend()
    assert "sliding_window" in backend.encoder_features
    out = backend.encoder_attention(qd, kd, vd, cud, 33, 0.1, sliding_window=4)
    assert_close(out.cpu(), reference(q, k, v, cu, 33, 0.1, sliding_window=4))


def test_encoder_empty_sequences_and_batch(kernel_device):
    _check((0, 5, 0, 3, 0), 2, 32, torch.float32, kernel_device, EncoderLaunch(16, 16, 4, 1, "ieee"))
    empty = torch.empty(0, 2, 32, device=kernel_device)
    cu = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    assert encoder_attention(empty, empty, empty, cu, 0, 1.0).shape == (0, 2, 32)


def test_encoder_through_the_backend(kernel_device):
    (q, k, v, cu), (qd, kd, vd, cud) = _inputs((3, 33), 4, 80, torch.float16, kernel_device, seed=9)
    out = TritonAttentionBackend().encoder_attention(qd, kd, vd, cud, 33, 0.1)
    assert_close(out.cpu(), reference(q.float(), k.float(), v.float(), cu, 33, 0.1).to(torch.float16))


def test_encoder_launch_heuristics():
    nvidia = ArchInfo(vendor="nvidia", num_sms=132, capability=(9, 0))
    amd = ArchInfo(vendor="amd", num_sms=304, warp_size=64, arch_name="gfx942")
    window = choose_encoder_launch(nvidia, 80, 16, torch.bfloat16)  # a Qwen2.5-VL window: tiles fit it
    assert (window.block_m, window.block_n, window.input_precision) == (16, 16, "tf32")
    image = choose_encoder_launch(nvidia, 64, 577, torch.float32)
    assert (image.block_m, image.block_n, image.input_precision, image.num_stages) == (64, 64, "ieee", 3)
    assert choose_encoder_launch(amd, 64, 577, torch.float16).block_m == 32
    assert choose_encoder_launch(amd, 64, 577, torch.float16).input_precision == "ieee"
    assert choose_encoder_launch(nvidia, 256, 577, torch.float16).block_n == 32
    for arch in (nvidia, amd):
        for d, n in ((32, 1), (80, 7), (128, 100), (256, 4096)):
            launch = choose_encoder_launch(arch, d, n, torch.bfloat16)
            assert launch.block_m >= 16 and launch.block_n >= 16  # tl.dot's smallest tile on GPUs
