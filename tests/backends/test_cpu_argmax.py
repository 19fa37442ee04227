"""The native row argmax (`csrc/argmax.cpp`) the cpu platform gives the sampler: the same index as
torch.argmax(x, dim=-1) on every input, ties, NaN and infinities included."""

from __future__ import annotations

import pytest
import torch

from portside.backends.cpu import native_ops
from portside.backends.cpu.platform import CpuPlatform
from portside.config import EngineConfig, ModelConfig
from portside.sample.metadata import SamplingMetadata
from portside.sample.sampler import Sampler
from portside.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native_ops.unavailable_reason() is not None, reason="native library does not build here")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.portside_cpu_native.argmax_rows(x)


@pytest.mark.parametrize("shape", [(1, 49152), (64, 1000), (3, 17), (5, 16), (2, 1), (0, 8)])
def test_matches_torch_on_random_rows(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_infinities():
    n = 100  # a vector tail of 4 after six 16-wide blocks
    rows = torch.full((9, n), -1.0)
    rows[0, [5, 40, 97]] = 3.0  # tie: the first
    rows[1, [98, 99]] = 2.0  # tie in the scalar tail
    rows[2, 33] = float("nan")  # NaN beats every number
    rows[2, 50] = float("inf")
    rows[3, [70, 12]] = float("nan")  # first NaN, though a later vector block holds one too
    rows[4] = float("-inf")  # all -inf: index 0
    rows[5, 99] = float("inf")
    rows[6, :] = 0.0  # all equal
    rows[7, 0] = float("nan")
    rows[8, 64] = -0.0  # -0.0 == 0.0 for both: the first of them
    rows[8, 80] = 0.0
    assert argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist() == [5, 98, 33, 12, 0, 99, 0, 0, 64]


def test_other_inputs_go_to_torch():
    x = torch.randn(4, 40)
    for t in (x.double(), x.bfloat16(), x[:, ::2], x.t(), x[0]):
        assert torch.equal(argmax_rows(t), t.argmax(dim=-1))
    strided_rows = torch.randn(8, 64)[::2]  # rows apart, each dense: the native path
    assert torch.equal(argmax_rows(strided_rows), strided_rows.argmax(dim=-1))


def test_platform_sampler_uses_it_and_samples_as_core():
    config = EngineConfig(model=ModelConfig(path="unused"))
    sampler = CpuPlatform.sampler(config)
    assert sampler.argmax is torch.ops.portside_cpu_native.argmax_rows
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=0.9, seed=s) for s in range(4)]

    def md() -> SamplingMetadata:  # anew for each: a seeded row's generator advances as it draws
        return SamplingMetadata.build(params, [[1, 2]] * 6, [[]] * 6, eos_token_id=None, vocab_size=300, device="cpu")

    assert torch.equal(sampler(logits, md()).sampled_token_ids, Sampler()(logits, md()).sampled_token_ids)
