"""cpu weight placement: every weight in one huge-page-advised buffer, results unchanged."""

from __future__ import annotations

import torch
from torch import nn

from portside.backends.cpu.weights import ALIGN, pack_weights
from portside.contract import HUGE_PAGE, host_zeros


def test_host_zeros_is_zeroed_aligned_and_sized():
    t = host_zeros(3 * HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 5
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(7)  # writable
    assert int(t[-1]) == 7


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_host_zeros_prefault_maps_every_page_now():
    """Lazily mapped by default (nothing resident until written); `prefault` maps it all at once."""
    n = 64 << 20
    before = _resident_bytes()
    lazy = host_zeros(n)
    assert _resident_bytes() - before < n // 4
    before = _resident_bytes()
    eager = host_zeros(n, prefault=True)
    assert _resident_bytes() - before >= n * 3 // 4
    assert int(eager.count_nonzero()) == 0 and int(lazy.count_nonzero()) == 0


def test_pack_weights_moves_every_tensor_into_one_buffer_keeping_ties_and_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 11, bias=False))
    model[3].weight = model[0].weight  # tied, as an LM head with its embedding
    model.register_buffer("cos", torch.randn(4, 3))
    x = torch.tensor([1, 4, 9])
    before = model(x).clone()
    values = {k: v.clone() for k, v in model.state_dict().items()}
    packed = pack_weights(model)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    assert len(tensors) == 6  # embedding (tied with the head), linear w + b, norm w + b, buffer
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1  # one buffer
    assert all(t.data_ptr() % ALIGN == 0 for t in tensors.values())
    assert packed >= sum(t.numel() * t.element_size() for t in tensors.values())
    assert model[3].weight is model[0].weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), k
    assert torch.equal(model(x), before)
