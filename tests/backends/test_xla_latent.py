"""Latent attention (MLA) on the tpu platform (torch-xla's PJRT CPU device in the xla leg; skipped
without torch-xla): the xla attention backend keeps core's latent layout and reference
(`portside.ops.mla`), writing rows with one unconditional scatter (`XlaAttentionBackend.write_latent`).

- the kernels on the XLA device equal the CPU reference over the conformance kit's mixed batches,
  a padded token (slot -1) writes nothing, and nothing runs as an ATen CPU fallback;
- a tiny DeepSeek-V3 model generates transformers' greedy tokens through the engine (the runner
  runs MLA models op by op, outside the bucketed graphs, as it does hybrid models).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from portside.ops import mla as ref
from portside.testing.conformance.cases import batches, build_metadata, ordered, random_block_tables

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
pytestmark = [pytest.mark.xla,
              pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not importable (the xla leg installs it)")]

if HAS_XLA:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla starts its runtime

BLOCK, HEADS, LATENT, ROPE, POOL = 16, 4, 32, 8, 40


@pytest.fixture(scope="module")
def xla_device() -> torch.device:
    from portside.backends.xla.platform import XlaPlatform

    avail = XlaPlatform.is_available()
    if not avail:
        pytest.skip(f"tpu platform unavailable: {avail.reason}")
    return XlaPlatform.device()


@pytest.mark.parametrize("batch", ["decodes", "prefills", "mixed"])
def test_latent_attention_on_the_xla_device_matches_cpu(batch: str, xla_device: torch.device) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met

    from portside.backends.xla.attention import XlaAttentionBackend

    gen = torch.Generator().manual_seed(len(batch))
    d = LATENT + ROPE
    requests = ordered(batches(BLOCK)[batch])
    tables = random_block_tables(requests, BLOCK, POOL, gen)
    cache = torch.randn(ref.latent_cache_shape(POOL, BLOCK, d), generator=gen)
    md = build_metadata(requests, tables, BLOCK, torch.device("cpu"))
    q = torch.randn(md.num_tokens, HEADS, d, generator=gen)
    latent = torch.randn(md.num_tokens, d, generator=gen)
    want_cache = cache.clone()
    want = ref.latent_attention(q, latent, want_cache, md, 0.2, LATENT)

    backend = XlaAttentionBackend()
    assert backend.latent_cache_shape(POOL, BLOCK, d) == cache.shape
    dev_cache = cache.to(xla_device)
    dev_md = build_metadata(requests, tables, BLOCK, xla_device)
    torch_xla.sync()
    met.clear_counters()
    with torch.no_grad():
        got = backend.latent_attention(q.to(xla_device), latent.to(xla_device), dev_cache, dev_md, 0.2, LATENT)
    torch_xla.sync()
    fallbacks = sorted(n for n in met.counter_names() if n.startswith("aten::"))
    assert not fallbacks, f"ops run on the host (CPU fallback): {fallbacks}"
    torch.testing.assert_close(got.cpu(), want)  # fp32
    assert torch.equal(dev_cache.cpu(), want_cache)


def test_write_latent_drops_padding(xla_device: torch.device) -> None:
    from portside.backends.xla.attention import XlaAttentionBackend

    backend = XlaAttentionBackend()
    cache = torch.zeros(backend.latent_cache_shape(3, BLOCK, 10), device=xla_device)
    slots = torch.tensor([5, -1, 2 * BLOCK + 3, -1], dtype=torch.int64)
    rows = torch.randn(4, 10)
    backend.write_latent(cache, rows.to(xla_device), slots.to(xla_device))
    want = torch.zeros(3 * BLOCK, 10)
    want[[5, 2 * BLOCK + 3]] = rows[[0, 2]]
    assert torch.equal(backend.read_latent(cache, torch.arange(3 * BLOCK, device=xla_device)).cpu(), want)


@pytest.mark.slow
def test_deepseek_greedy_through_the_engine(xla_device: torch.device, tmp_path) -> None:
    from portside import LLM, SamplingParams
    from portside.testing.tiny import hf_greedy
    from portside.testing.tiny_deepseek import make_tiny_deepseek

    path = make_tiny_deepseek(tmp_path / "m", "v3", q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1,
                              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)  # fmt: skip
    prompts = [[5, 17, 33, 9, 60, 12, 7], list(range(20, 45))]
    llm = LLM(model=str(path), device="tpu", max_model_len=64, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=32, num_kv_blocks=16)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
