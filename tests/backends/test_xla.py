"""The xla backend (TPU through torch-xla), proven on torch-xla's PJRT CPU device.

Run in the xla leg (`ci/legs/xla.sh`): ``PJRT_DEVICE=CPU python -m pytest tests/backends/test_xla.py``.
Tests that need torch_xla skip with the reason elsewhere; the probe and bucket tests run in
every leg.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portside.backends.xla.buckets import Buckets, BucketShape, parse_buckets, powers_of_two
from portside.contract import AttentionMetadata

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
needs_xla = pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not importable (the xla leg installs it: ci/legs/xla.sh)")

if HAS_XLA:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla starts its runtime


# ---- probe and registration (every leg) ---------------------------------------------------------


def test_register_does_not_import_torch_xla():
    code = (
        "import sys; from portside.backends.xla import register; "
        "from portside.backends.xla.platform import XlaPlatform; "
        "target = register(); XlaPlatform.is_available(); "
        "assert 'torch_xla' not in sys.modules, 'torch_xla imported'; print(target)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "portside.backends.xla.platform:XlaPlatform"


def test_probe_reasons(monkeypatch):
    from portside.backends.xla import platform as xp

    monkeypatch.setattr(xp.importlib.util, "find_spec", lambda name: None)
    reason = xp.XlaPlatform.is_available().reason
    assert "torch-xla is not installed" in reason and "pip install" in reason


@needs_xla
def test_probe_pjrt_cpu_and_tpu(monkeypatch):
    from portside.backends.xla import platform as xp

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert xp.XlaPlatform.is_available()
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")
    assert "not a TPU" in xp.XlaPlatform.is_available().reason
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr(xp, "tpu_present", lambda: False)
    assert "no TPU found" in xp.XlaPlatform.is_available().reason
    monkeypatch.setattr(xp, "tpu_present", lambda: True)
    assert xp.XlaPlatform.is_available()


def test_version_mismatch_names_both(monkeypatch):
    from portside.backends.xla import platform as xp

    monkeypatch.setattr(xp.importlib.metadata, "version", lambda name: "2.1.0")
    monkeypatch.setattr(xp.torch, "__version__", "2.13.0+cpu")
    msg = xp.version_mismatch()
    assert msg is not None and "torch-xla 2.1.0" in msg and "torch 2.13.0+cpu" in msg


# ---- buckets (every leg) ------------------------------------------------------------------------


def test_bucket_defaults_and_selection():
    assert powers_of_two(16, 100) == (16, 32, 64, 100)
    assert powers_of_two(1, 1) == (1,)
    b = Buckets.from_limits(max_num_tokens=64, max_num_reqs=4, max_width=8)
    assert b.tokens == (16, 32, 64) and b.requests == (1, 2, 4) and b.widths == (1, 2, 4, 8)
    assert len(b.shapes()) == 3 * 3 * 4
    assert b.select(5, 3, 3) == (BucketShape(16, 4, 4), True)
    assert b.select(64, 4, 8) == (BucketShape(64, 4, 8), True)
    assert b.select(65, 1, 1) == (BucketShape(128, 1, 1), False)  # outside: next power of two
    assert b.select(10, 5, 9) == (BucketShape(16, 8, 16), False)
    with pytest.raises(ValueError):
        parse_buckets("16,x")


def test_bucket_shapes_skip_more_requests_than_tokens():
    b = Buckets(tokens=(2, 8), requests=(1, 4), widths=(1,))
    assert b.shapes() == [BucketShape(2, 1, 1), BucketShape(8, 1, 1), BucketShape(8, 4, 1)]


# ---- on the XLA device ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xla_device():
    if not HAS_XLA:
        pytest.skip("torch_xla is not importable")
    from portside.backends.xla.platform import XlaPlatform

    avail = XlaPlatform.is_available()
    if not avail:
        pytest.skip(f"tpu platform unavailable: {avail.reason}")
    return XlaPlatform.device()


def _backend():
    from portside.backends.xla.attention import XlaAttentionBackend

    return XlaAttentionBackend(use_pallas=False)


@needs_xla
def test_kv_cache_round_trip(xla_device):
    backend = _backend()
    nb, bs, kvh, d = 9, 4, 2, 8
    cache = torch.zeros(backend.kv_cache_shape(nb, bs, kvh, d), device=xla_device)
    assert cache.shape == (nb, bs, 2 * kvh, d)  # exactly K and V: core sizes the pool from KVCacheSpec
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(nb * bs, generator=g)[:13]
    slots_with_pad = torch.cat([slots[:6], torch.tensor([-1, -1]), slots[6:]])  # padding in the middle
    k = torch.randn(15, kvh, d, generator=g)
    v = torch.randn(15, kvh, d, generator=g)
    backend.write_kv(cache, k.to(xla_device), v.to(xla_device), slots_with_pad.to(xla_device))
    keep = slots_with_pad >= 0
    k_back, v_back = backend.read_kv(cache, slots.to(xla_device))
    torch.testing.assert_close(k_back.cpu(), k[keep])
    torch.testing.assert_close(v_back.cpu(), v[keep])
    # Every other slot is untouched: padding (slot -1) was written nowhere.
    others = torch.tensor(sorted(set(range(nb * bs)) - set(slots.tolist())))
    k_rest, v_rest = backend.read_kv(cache, others.to(xla_device))
    assert k_rest.abs().sum().item() == 0 and v_rest.abs().sum().item() == 0


def _ragged_batch(query_lens, seq_lens, block_size, num_blocks, g):
    """Metadata (CPU tensors) for requests given (query_len, seq_len), block tables drawn at
    random without repetition from a pool of `num_blocks`."""
    widths = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    slots, at = [], 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        blocks = perm[at : at + widths[i]]
        at += widths[i]
        table[i, : widths[i]] = torch.tensor(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        num_decode_tokens=sum(1 for q in query_lens if q == 1),
    )


def _to(md: AttentionMetadata, device) -> AttentionMetadata:
    import dataclasses

    return dataclasses.replace(
        md,
        slot_mapping=md.slot_mapping.to(device),
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_tables=md.block_tables.to(device),
    )


def _check_attention(xla_device, num_heads, num_kv_heads, head_size, block_size, **features):
    """Ragged mixed batch: decodes (kv_len 1, block_size, block_size + 1), a prefill chunk over
    a cached prefix and a whole prefill; history written first, then the step's tokens by
    `ForwardContext.attention` (with the layer's `features`), against core's reference."""
    from portside.attention import reference
    from portside.contract import ForwardContext

    g = torch.Generator().manual_seed(num_heads * 100 + head_size)
    query_lens = [1, 1, 1, 5, 9]
    seq_lens = [1, block_size, block_size + 1, 2 * block_size + 3, 9]
    num_blocks = 40
    md = _ragged_batch(query_lens, seq_lens, block_size, num_blocks, g)
    ref_backend, backend = reference.ReferenceAttentionBackend(), _backend()
    ref_cache = torch.zeros(ref_backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), device=xla_device)
    # cached history (the tokens before each request's query) into both caches
    hist_slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        blocks = md.block_tables[i].tolist()
        hist_slots += [blocks[p // block_size] * block_size + p % block_size for p in range(0, s - q)]
    if hist_slots:
        hk = torch.randn(len(hist_slots), num_kv_heads, head_size, generator=g)
        hv = torch.randn(len(hist_slots), num_kv_heads, head_size, generator=g)
        hs = torch.tensor(hist_slots)
        ref_backend.write_kv(ref_cache, hk, hv, hs)
        backend.write_kv(cache, hk.to(xla_device), hv.to(xla_device), hs.to(xla_device))
    t = md.num_tokens
    q = torch.randn(t, num_heads, head_size, generator=g)
    k = torch.randn(t, num_kv_heads, head_size, generator=g)
    v = torch.randn(t, num_kv_heads, head_size, generator=g)
    scale = head_size**-0.5
    expected = ref_backend.forward(q, k, v, ref_cache, md, scale, **features)
    ctx = ForwardContext(backend, [cache], backend.prepare(_to(md, xla_device)))
    got = ctx.attention(0, q.to(xla_device), k.to(xla_device), v.to(xla_device), scale, **features)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    # the step's K/V landed in the cache too
    kb, vb = backend.read_kv(cache, md.slot_mapping.to(xla_device))
    torch.testing.assert_close(kb.cpu(), k)
    torch.testing.assert_close(vb.cpu(), v)


@needs_xla
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size",
    [(4, 4, 16, 4), (8, 2, 16, 4), (8, 1, 32, 8)],
)
def test_attention_matches_reference(xla_device, num_heads, num_kv_heads, head_size, block_size):
    _check_attention(xla_device, num_heads, num_kv_heads, head_size, block_size)


@needs_xla
@pytest.mark.parametrize(
    "block_size,features",
    [
        (4, {"sliding_window": 1}),  # only the token itself
        (4, {"sliding_window": 3}),  # smaller than a block and than most sequences
        (4, {"sliding_window": 6}),  # across a block boundary, into the cached prefix
        (4, {"sliding_window": 100}),  # longer than every sequence: plain causal attention
        (4, {"logit_softcap": 2.0}),
        (4, {"sliding_window": 5, "logit_softcap": 2.0}),
        (8, {"sliding_window": 10, "logit_softcap": 1.5}),
    ],
    ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else f"bs{x}",
)
def test_attention_features_match_reference(xla_device, monkeypatch, block_size, features):
    """Sliding windows and logit softcaps computed by the xla backend itself (core's read_kv
    fallback, which no XLA graph should run, would fail the test)."""
    from portside.attention import reference

    def fallback(*args, **kwargs):
        raise AssertionError("core's read_kv fallback ran: the xla backend did not take the features")

    monkeypatch.setattr(reference, "attention_through_read_kv", fallback)
    assert set(features) <= _backend().features
    _check_attention(xla_device, 8, 2, 16, block_size, **features)


PADDED_FEATURES = {"sliding_window": 3, "logit_softcap": 2.0}


@needs_xla
@pytest.mark.parametrize(
    "shape,features",
    [
        (BucketShape(16, 4, 8), {}),
        (BucketShape(16, 4, 8), PADDED_FEATURES),
        # no padding request: padding tokens belong to the last request, past its block table,
        # where the window leaves them no key (the backend then gives them key 0, not NaN)
        (BucketShape(64, 3, 3), PADDED_FEATURES),
    ],
    ids=["plain", "features", "features-past-the-table"],
)
def test_attention_padded_batch_matches_unpadded(xla_device, shape, features):
    """The graph runner's padding (extra tokens at slot -1, extra empty requests, wider block
    tables) leaves the real rows' output unchanged, and every padding row finite."""
    from portside.backends.xla.graph import _pad_inputs
    from portside.contract import ForwardContext

    g = torch.Generator().manual_seed(7)
    block_size, kvh, heads, d = 4, 2, 4, 16
    md = _ragged_batch([1, 1, 6], [3, 5, 10], block_size, 20, g)
    backend = _backend()
    cache = torch.randn(backend.kv_cache_shape(20, block_size, kvh, d), generator=g).to(xla_device)
    t = md.num_tokens
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kvh, kvh))
    base = backend.forward(q.to(xla_device), k.to(xla_device), v.to(xla_device), cache.clone(),
                           _to(md, xla_device), 0.25, **features).cpu()
    ids = torch.zeros(t, dtype=torch.int64, device=xla_device)
    _, _, padded = _pad_inputs(shape, ForwardContext(backend, [cache], _to(md, xla_device)), block_size, xla_device,
                               input_ids=ids, positions=ids)
    assert padded.num_tokens == shape.num_tokens and padded.num_reqs == shape.num_reqs
    assert padded.block_tables.shape[1] == shape.width

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(shape.num_tokens - t, *x.shape[1:], generator=g)]).to(xla_device)

    out = backend.forward(pad(q), pad(k), pad(v), cache.clone(), backend.with_data(padded), 0.25, **features).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:t], base, atol=1e-5, rtol=1e-5)


# ---- encoder attention (non-causal, packed sequences; vision towers) ------------------------------

ENCODER_LENGTHS = [(7, 100, 1, 64, 16), (1,), (16, 16, 16, 9)]


def _encoder_inputs(lengths, heads, d, dtype, g):
    cu = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), heads, d, generator=g).to(dtype) for _ in range(3))
    return q, k, v, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lengths", ENCODER_LENGTHS, ids=lambda x: "-".join(map(str, x)))
def test_encoder_attention_masked_on_cpu_tensors(lengths, dtype):
    """The block-diagonal formulation against core's reference, on CPU tensors (every leg)."""
    from portside.attention.reference import encoder_attention
    from portside.backends.xla.attention import encoder_attention_masked
    from portside.testing.tolerances import assert_close

    g = torch.Generator().manual_seed(len(lengths))
    q, k, v, cu = _encoder_inputs(lengths, 3, 80, dtype, g)
    out = _backend().encoder_attention(q, k, v, cu, max(lengths), 0.1)
    want = encoder_attention(q.float(), k.float(), v.float(), cu, max(lengths), 0.1).to(dtype)
    assert out.dtype == dtype
    assert_close(out, want)
    assert torch.equal(out, encoder_attention_masked(q, k, v, cu, 0.1))


@pytest.mark.parametrize("window", [0, 3, 40])
def test_encoder_attention_masked_window_on_cpu_tensors(window):
    """ModernBERT's local layers (encoder feature sliding_window) in the masked formulation."""
    from portside.attention.reference import encoder_attention

    g = torch.Generator().manual_seed(window)
    q, k, v, cu = _encoder_inputs((7, 100, 1, 64, 16), 3, 16, torch.float32, g)
    assert "sliding_window" in _backend().encoder_features
    out = _backend().encoder_attention(q, k, v, cu, 100, 0.1, sliding_window=window)
    torch.testing.assert_close(out, encoder_attention(q, k, v, cu, 100, 0.1, sliding_window=window), atol=1e-5, rtol=1e-5)


def test_encoder_attention_masked_padding_rows_stay_finite():
    """Rows past cu_seqlens[-1] (a padded batch) attend among themselves: finite, and the real
    rows are unchanged by them."""
    from portside.backends.xla.attention import encoder_attention_masked

    g = torch.Generator().manual_seed(3)
    q, k, v, cu = _encoder_inputs((5, 3), 2, 16, torch.float32, g)
    pad = torch.randn(4, 2, 16, generator=g)
    out = encoder_attention_masked(torch.cat([q, pad]), torch.cat([k, pad]), torch.cat([v, pad]), cu, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:8], encoder_attention_masked(q, k, v, cu, 0.25))


@needs_xla
def test_encoder_attention_on_the_xla_device(xla_device):
    """On the device against core's reference; other lengths of the same total T and sequence
    count reuse the compiled program."""
    from portside.attention.reference import encoder_attention
    from portside.backends.xla.graph import compile_count

    g = torch.Generator().manual_seed(11)
    backend = _backend()
    compiled = []
    for lengths in [(7, 100, 1, 64, 16), (40, 40, 40, 40, 28)]:  # T = 188, S = 5 both times
        q, k, v, cu = _encoder_inputs(lengths, 4, 80, torch.float32, g)
        before = compile_count()
        out = backend.encoder_attention(q.to(xla_device), k.to(xla_device), v.to(xla_device), cu.to(xla_device),
                                        max(lengths), 0.1).cpu()
        compiled.append(compile_count() - before)
        want = encoder_attention(q, k, v, cu, max(lengths), 0.1)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert compiled[1] == 0, compiled


def _routing(num_tokens, num_experts, top_k, g):
    """Each token's top_k distinct experts, drawn so that the last expert receives no token
    (whenever top_k < num_experts), and fp32 weights."""
    pool = num_experts - 1 if top_k < num_experts else num_experts
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    return weights, ids.to(torch.int64)


@needs_xla
@pytest.mark.parametrize("num_experts,top_k", [(2, 1), (2, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_moe_experts_match_reference(xla_device, num_experts, top_k, activation):
    """The platform's dense moe_experts against core's reference; a second routing of the same
    shapes compiles no new program."""
    from portside.backends.xla.graph import compile_count
    from portside.backends.xla.platform import XlaPlatform
    from portside.ops.moe import moe_experts

    ops = XlaPlatform.model_ops(None)
    assert ops.name == "xla-dense"
    g = torch.Generator().manual_seed(num_experts * 10 + top_k)
    tokens, hidden, inter = 7, 16, 8
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    dev = [t.to(xla_device) for t in (x, w13, w2)]
    compiled = []
    for _ in range(2):
        weights, ids = _routing(tokens, num_experts, top_k, g)
        before = compile_count()
        got = ops.moe_experts(*dev, weights.to(xla_device), ids.to(xla_device), activation).cpu()
        compiled.append(compile_count() - before)
        assert got.dtype == x.dtype and got.shape == x.shape
        torch.testing.assert_close(got, moe_experts(x, w13, w2, weights, ids, activation), atol=1e-5, rtol=1e-5)
    assert compiled[1] == 0, compiled
    # fused_moe (routing on the device, then these experts) agrees too
    logits = torch.randn(tokens, num_experts, generator=g)
    got = ops.fused_moe(dev[0], logits.to(xla_device), *dev[1:], top_k, renormalize=True, activation=activation)
    weights, ids = ops.select_experts(logits, top_k, renormalize=True)
    torch.testing.assert_close(got.cpu(), moe_experts(x, w13, w2, weights, ids, activation), atol=1e-5, rtol=1e-5)


@needs_xla
def test_collectives_world_size_one(xla_device):
    from portside.backends.xla.platform import XlaPlatform

    comm = XlaPlatform.communicator()
    assert comm.name == "xla" and comm.world_size == 1 and comm.rank == 0
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.testing.assert_close(comm.all_reduce(x.to(xla_device)).cpu(), x)
    torch.testing.assert_close(comm.all_gather(x.to(xla_device), dim=-1).cpu(), x)
    torch.testing.assert_close(comm.all_gather(x.to(xla_device), dim=0).cpu(), x)
    torch.testing.assert_close(comm.broadcast(x.to(xla_device), src=0).cpu(), x)
    comm.barrier()


# ---- end to end -----------------------------------------------------------------------------

GREEDY_TOKENS = 12
WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
         "and the river runs to the sea under a bright sky full of birds").split()
# small buckets: 2 x 2 x 2 = 8 programs to precompile (a few seconds on PJRT CPU)
BUCKET_OPTIONS = {"xla_token_buckets": "16,64", "xla_request_buckets": "1,4", "xla_width_buckets": "4,8"}


def _prompts(tokenizer, lengths):
    base = tokenizer.encode(" ".join(WORDS * 4))
    return [base[3 * i : 3 * i + n] for i, n in enumerate(lengths)]


def _llm(model_path: Path, num_kv_blocks: int, **options: str):
    """An engine on the tpu platform. XLA caches compiled programs per process, keyed by the
    graph: a distinct `num_kv_blocks` (cache shape) gives an engine its own programs."""
    from portside import LLM

    return LLM(model=str(model_path), device="tpu", max_model_len=128, block_size=16, max_num_seqs=4,
               max_num_batched_tokens=64, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False,
               platform_options={**BUCKET_OPTIONS, **options})


def _runner(llm):
    return llm.engine.executor.runner


@pytest.fixture(scope="module")
def xla_llm(xla_device, tiny_llama):
    return _llm(tiny_llama, 64, xla_strict="1")


@needs_xla
def test_engine_runs_on_the_xla_device(xla_llm):
    runner = _runner(xla_llm)
    assert runner.device.type == "xla"
    assert next(runner.model.parameters()).device.type == "xla"
    assert all(c.device.type == "xla" for c in runner.kv_caches)
    assert type(runner.graph_runner).__name__ == "XlaGraphRunner"


@needs_xla
def test_greedy_parity_with_transformers(xla_llm, tiny_llama):
    """Batched ragged prompts (across block boundaries, chunked by the 64-token budget) give
    exactly transformers' greedy tokens, through the xla backend."""
    from portside import SamplingParams
    from portside.testing.tiny import hf_greedy

    prompts = _prompts(xla_llm.get_tokenizer(), [3, 17, 40, 9])
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = xla_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(tiny_llama, prompt, GREEDY_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


@needs_xla
def test_no_compilation_after_warmup(xla_llm):
    """Every bucket compiled at startup; a workload inside the buckets compiles nothing more,
    neither in the model step (strict mode would raise) nor anywhere once its sampler shapes
    have been seen."""
    from portside import SamplingParams
    from portside.backends.xla.graph import compile_count

    gr = _runner(xla_llm).graph_runner
    assert gr.stats.warmup_compiles == len(gr.buckets.shapes()) == 8
    prompts = _prompts(xla_llm.get_tokenizer(), [5, 30, 12])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    steps_before = gr.stats.steps
    xla_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert gr.stats.steps > steps_before
    assert gr.stats.recompiles == 0, gr.stats.recompiled_shapes
    # the same workload again: not one XLA program compiled in the whole engine step
    before = compile_count()
    xla_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert compile_count() == before


# layer 0: a window shorter than the prompts and a softcap that bites; layer 1: a window across blocks
LAYER_FEATURES = ({"sliding_window": 5, "logit_softcap": 1.0}, {"sliding_window": 20})


@needs_xla
def test_attention_features_through_the_engine(xla_device, tiny_llama, monkeypatch):
    """A model whose layers ask for sliding windows and softcaps runs through the bucketed
    graphs: greedy tokens equal core's reference attention (fp32, eager, on the CPU), and after
    warm-up nothing compiles (strict mode)."""
    from portside import SamplingParams
    from portside.attention.reference import ReferenceAttentionBackend
    from portside.config import ModelConfig
    from portside.model.llama import LlamaForCausalLM
    from portside.model.registry import load_model
    from portside.testing.paged import PagedSequence

    monkeypatch.setattr(LlamaForCausalLM, "attention_features", lambda self, i: LAYER_FEATURES[i % 2])
    llm = _llm(tiny_llama, 53, xla_strict="1")
    gr = _runner(llm).graph_runner
    prompts = _prompts(llm.get_tokenizer(), [3, 17, 40, 9])
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert gr.stats.warmup_compiles == len(gr.buckets.shapes()) and gr.stats.recompiles == 0
    model = load_model(ModelConfig(path=str(tiny_llama), max_model_len=128), torch.device("cpu"))
    for prompt, out in zip(prompts, outs):
        expected = PagedSequence(model, ReferenceAttentionBackend(), block_size=16).greedy(prompt, GREEDY_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


@needs_xla
def test_strict_mode_catches_a_shape_outside_the_buckets(xla_device, tiny_llama):
    from portside import SamplingParams
    from portside.backends.xla.graph import RecompilationError

    llm = _llm(tiny_llama, 37, xla_strict="1", xla_token_buckets="16")
    prompt = _prompts(llm.get_tokenizer(), [40])[0]  # 40 tokens: beyond the only token bucket (16)
    with pytest.raises(RecompilationError, match="outside the buckets"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)


@needs_xla
def test_portside_devices_lists_tpu():
    """`portside devices` shows the tpu platform: available on PJRT CPU, else why not."""
    from portside.backends.xla.platform import tpu_present

    def tpu_line(pjrt: str) -> list[str]:
        env = {**os.environ, "PJRT_DEVICE": pjrt}
        out = subprocess.run([sys.executable, "-m", "portside.cli", "devices"], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.split()[:1] == ["tpu"]), None)
        assert at is not None, out.stdout
        block = [lines[at]]
        for ln in lines[at + 1:]:  # its wrapped cells and reason lines are indented under it
            if not ln.startswith(" "):
                break
            block.append(ln)
        return " ".join(block).split()

    cpu = tpu_line("CPU")
    assert cpu[1] == "available" and "xla-buckets" in cpu, cpu
    tpu = tpu_line("TPU")
    if tpu_present():
        assert tpu[1] == "available", tpu
    else:
        assert tpu[1] == "unavailable" and "no TPU found" in " ".join(tpu), tpu


@needs_xla
@pytest.mark.parametrize("fmt", ["int8", "gptq"])
def test_quantized_models_through_the_bucketed_graphs(xla_device, tiny_llama, tmp_path, fmt):
    """Quantized weights run on xla through core's reference (dequantize, then matmul, traced into
    the bucketed graphs): int8 at load and a GPTQ int4 checkpoint give transformers' greedy tokens
    on the dequantized weights, and after warm-up nothing compiles (strict mode)."""
    from portside import SamplingParams
    from portside.testing.quant_checkpoints import write_quantized
    from portside.testing.tiny import hf_greedy

    if fmt == "gptq":
        path, oracle = write_quantized(tiny_llama, tmp_path / "gptq", "gptq", bits=4, group_size=32, desc_act=True)
        llm = _llm(path, 51, xla_strict="1")
    else:
        from safetensors.torch import load_file, save_file

        oracle = tmp_path / "oracle"
        shutil.copytree(tiny_llama, oracle)
        tensors = load_file(str(oracle / "model.safetensors"))
        for name, w in tensors.items():
            if name.endswith("proj.weight"):
                scale = (w.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
                tensors[name] = (w / scale).round().clamp(-127, 127) * scale
        save_file(tensors, str(oracle / "model.safetensors"), metadata={"format": "pt"})
        from portside import LLM

        llm = LLM(model=str(tiny_llama), device="tpu", max_model_len=128, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=64, num_kv_blocks=52, enable_prefix_caching=False, quantization="int8",
                  platform_options={**BUCKET_OPTIONS, "xla_strict": "1"})
    gr = _runner(llm).graph_runner
    prompts = _prompts(llm.get_tokenizer(), [3, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert gr.stats.recompiles == 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, GREEDY_TOKENS), f"prompt of {len(prompt)} tokens"
