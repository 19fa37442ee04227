"""`--kv-cache-dtype`: 8-bit KV caches (fp8_e4m3, fp8_e5m2, int8).

The formats are core's (`portside.contract.quantize_kv`); the cpu backend's torch path and
native C kernels store them bit for bit as the reference does and attend over them within fp32
tolerances of the reference's attention over its own 8-bit cache. Against attention over the
exact values an 8-bit cache is within `KV_CACHE_TOLERANCES`. End to end: a tiny Llama with a
clear-margin init generates the auto cache's greedy tokens, and exactly the tokens of the
reference over the same 8-bit cache; the pool holds 4x (fp32 model) the blocks in the same
memory (int8: (head_size + 4) bytes a row); checkpoint k/v scales are loaded and applied; a
backend that cannot store a dtype is refused with a message naming --kv-cache-dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tolerances import KV_CACHE_TOLERANCES, KV_ROUND_TRIP, TOLERANCES, kv_round_trip_bound  # tests/ is on sys.path

from portside.attention import reference
from portside.backends.cpu import kernels
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.config import CacheConfig, EngineConfig, ModelConfig
from portside.contract import (
    AttentionBackend,
    Availability,
    DeviceInfo,
    KVCacheSpec,
    Platform,
    dequantize_kv,
    kv_cache_dtype_name,
    kv_cache_torch_dtype,
    kv_row_bytes,
    quantize_kv,
)
from portside.testing.conformance.cases import batches, build_metadata, ordered, random_block_tables

Q8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
CPU = torch.device("cpu")


def _native() -> NativeAttentionBackend:
    reason = kernels.native_unavailable_reason()
    if reason:
        pytest.skip(f"native cpu kernels unavailable: {reason}")
    return NativeAttentionBackend()


BACKENDS = {"torch": CpuAttentionBackend, "native": _native}


# ---- names, sizes, formats -------------------------------------------------------------------


def test_names_resolve_and_unknown_ones_are_refused():
    assert kv_cache_dtype_name("fp8") == "fp8_e4m3"
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_cache_dtype_name("fp4")


def test_spec_sizes_the_pool_by_the_stored_bytes():
    fp32 = KVCacheSpec(num_layers=30, num_kv_heads=3, head_size=64, dtype=torch.float32)
    bf16 = dataclasses.replace(fp32, dtype=torch.bfloat16)
    assert fp32.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert dataclasses.replace(fp32, cache_dtype=torch.float8_e4m3fn).bytes_per_token * 4 == fp32.bytes_per_token
    assert dataclasses.replace(bf16, cache_dtype=torch.float8_e5m2).bytes_per_token * 2 == bf16.bytes_per_token
    assert dataclasses.replace(fp32, cache_dtype=torch.int8).bytes_per_token == 2 * 30 * 3 * (64 + 4)
    assert kv_row_bytes(64, torch.int8) == 68 and kv_row_bytes(64, torch.bfloat16) == 128


def _spread(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose magnitudes span 2^-20 .. 2^9 (subnormal fp8 up to past e4m3's 448)."""
    mag = torch.pow(2.0, torch.empty(n, d).uniform_(-20, 9, generator=gen))
    return mag * torch.randn(n, d, generator=gen).sign()


@pytest.mark.parametrize("name", list(Q8))
def test_quantize_round_trip_within_one_step(name):
    cdt = Q8[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(64, 64, generator=gen) * 3, _spread(64, 64, gen).clamp(-400, 400)])
    rows = quantize_kv(x, cdt)
    assert rows.dtype == cdt and rows.shape == (128, kv_row_bytes(64, cdt))
    back = dequantize_kv(rows)
    assert ((back - x).abs() <= kv_round_trip_bound(x, cdt)).all()
    # half a step, as round-to-nearest gives (KV_ROUND_TRIP allows a whole one)
    tol = KV_ROUND_TRIP[cdt]
    half = 0.5 * (tol["rtol"] * x.abs() + tol["atol"] + tol["row"] * x.abs().amax(-1, keepdim=True))
    assert ((back - x).abs() <= half * (1 + 1e-6)).all()


def test_fp8_saturates_and_int8_rows_carry_their_scale():
    big = torch.tensor([[1e4, -1e6, 500.0, 0.0]])
    assert dequantize_kv(quantize_kv(big, torch.float8_e4m3fn)).tolist() == [[448.0, -448.0, 448.0, 0.0]]
    assert dequantize_kv(quantize_kv(big, torch.float8_e5m2)).tolist() == [[10240.0, -57344.0, 512.0, 0.0]]
    rows = quantize_kv(torch.tensor([[2.54, -1.27, 0.0, 0.01], [0.0, 0.0, 0.0, 0.0]]), torch.int8)
    assert rows[0, :4].tolist() == [127, -64, 0, 0] or rows[0, :4].tolist() == [127, -63, 0, 0]
    assert rows[0, 4:].contiguous().view(torch.float32).item() == pytest.approx(2.54 / 127)
    assert dequantize_kv(rows)[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # an all-zero row: scale 0


@pytest.mark.parametrize("name", list(Q8))
def test_native_writes_the_reference_bytes(name):
    """The C quantizer (csrc/paged_attention.c) equals quantize_kv bit for bit: every fp8 value and
    the midpoints between neighbours (ties round to even), subnormals, saturation, signed zeros."""
    cdt = Q8[name]
    backend = _native()
    gen = torch.Generator().manual_seed(1)
    d = 64
    rows = [torch.randn(32, d, generator=gen) * 5, _spread(64, d, gen), torch.zeros(2, d), -torch.zeros(2, d)]
    if cdt != torch.int8:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cdt).float()
        vals = codes[codes.isfinite()].unique()  # every finite fp8 value, sorted
        mids = (vals[1:] + vals[:-1]) / 2  # ties (fp32-exact)
        special = torch.cat([vals, mids, torch.tensor([1e5, -1e5, 1e9, -1e9, 464.0, 460.0, 61440.0])])
        special = special[torch.randperm(special.numel(), generator=gen)]
        rows.append(torch.cat([special, torch.zeros(-special.numel() % d)]).view(-1, d))
    else:  # rows whose x / scale lands on .5 exactly: round half to even
        rows.append(torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -3.5] + [0.0] * (d - 6)]))
    x = torch.cat(rows).view(-1, 1, d)  # one KV head
    n = x.shape[0]
    cache = backend.allocate_kv_cache(backend.cache_shape(-(-n // 16), 16, 1, d, cdt), cdt, CPU)
    backend.write_kv(cache, x, -x, torch.arange(n))
    flat = cache.view(torch.uint8).view(2, -1, kv_row_bytes(d, cdt))[:, :n]
    assert torch.equal(flat[0], quantize_kv(x[:, 0], cdt).view(torch.uint8))
    assert torch.equal(flat[1], quantize_kv(-x[:, 0], cdt).view(torch.uint8))


# ---- attention over an 8-bit cache -----------------------------------------------------------


def _run(backend: AttentionBackend, cdt: torch.dtype, requests, heads: int, kv_heads: int, d: int, bs: int = 16,
         seed: int = 0, **features):
    """(backend output, reference over its own 8-bit cache, reference over the exact values, both
    caches) for one batch whose prefixes are written through each side's write_kv."""
    gen = torch.Generator().manual_seed(seed)
    requests = ordered(requests)
    pool = sum(-(-(c + n) // bs) for c, n in requests) * 2 + 3
    tables = random_block_tables(requests, bs, pool, gen)
    cache = backend.allocate_kv_cache(backend.cache_shape(pool, bs, kv_heads, d, cdt), cdt, CPU)
    ref = torch.zeros(reference.cache_shape(pool, bs, kv_heads, d, cdt), dtype=cdt)
    exact = torch.zeros(reference.cache_shape(pool, bs, kv_heads, d), dtype=torch.float32)
    cached = [(c, t) for (c, _), t in zip(requests, tables) if c]
    if cached:
        md = build_metadata(tuple((0, c) for c, _ in cached), [t for _, t in cached], bs, CPU)
        k, v = (torch.randn(md.num_tokens, kv_heads, d, generator=gen) for _ in range(2))
        backend.write_kv(cache, k, v, md.slot_mapping)
        reference.write_kv(ref, k, v, md.slot_mapping)
        reference.write_kv(exact, k, v, md.slot_mapping)
    md = build_metadata(requests, tables, bs, CPU)
    q = torch.randn(md.num_tokens, heads, d, generator=gen)
    k, v = (torch.randn(md.num_tokens, kv_heads, d, generator=gen) for _ in range(2))
    out = backend.forward(q, k, v, cache, backend.prepare(md), d**-0.5, **features)
    reference.write_kv(ref, k, v, md.slot_mapping)
    reference.write_kv(exact, k, v, md.slot_mapping)
    args = (md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, d**-0.5)
    return (out, reference.paged_attention(q, ref, *args, **features), reference.paged_attention(q, exact, *args, **features),
            cache, ref)  # fmt: skip


CASES = {
    "decodes": ((15, 1), (16, 1), (0, 1), (49, 1)),  # decode-only: the native DecodeStep path
    "mixed": ((16, 1), (0, 1), (17, 3), (32, 18), (0, 5)),
    "long": ((127, 1), (128, 1), (300, 1), (520, 1)),  # split into 128-token pieces and merged
}


@pytest.mark.parametrize("name", list(Q8))
@pytest.mark.parametrize("impl", list(BACKENDS))
@pytest.mark.parametrize("batch", list(CASES))
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 128), (8, 1, 40)], ids=["gqa4-d64", "mha-d128", "gqa8-d40"])
def test_cpu_attention_over_8bit_cache(impl, name, batch, heads, kv_heads, d):
    cdt = Q8[name]
    backend = BACKENDS[impl]()
    out, expected, exact, cache, ref = _run(backend, cdt, CASES[batch], heads, kv_heads, d)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8)), "the cache differs from the reference's bytes"
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out, expected, atol=10 * tol["atol"], rtol=10 * tol["rtol"])
    kv_tol = KV_CACHE_TOLERANCES[cdt]
    assert ((out - exact).abs() <= kv_tol["atol"] + kv_tol["rtol"] * exact.abs()).all()


@pytest.mark.parametrize("name", list(Q8))
@pytest.mark.parametrize("impl", list(BACKENDS))
def test_cpu_attention_features_over_8bit_cache(impl, name):
    backend = BACKENDS[impl]()
    for features in ({"sliding_window": 11}, {"logit_softcap": 1.5}, {"sliding_window": 20, "logit_softcap": 1.5}):
        for batch in ("decodes", "mixed", "long"):
            out, expected, _, _, _ = _run(backend, Q8[name], CASES[batch], 8, 2, 64, seed=3, **features)
            where = f"{features} {batch}"
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=lambda m, where=where: f"{where}: {m}")


def test_bf16_queries_over_an_8bit_cache_take_the_torch_path():
    backend = _native()
    gen = torch.Generator().manual_seed(5)
    md = build_metadata(((0, 1), (20, 1)), [[3], [1, 4]], 16, CPU)
    cache = backend.allocate_kv_cache(backend.cache_shape(6, 16, 2, 64, torch.int8), torch.int8, CPU)
    ref = torch.zeros(reference.cache_shape(6, 16, 2, 64, torch.int8), dtype=torch.int8)
    q = torch.randn(2, 4, 64, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, 64, generator=gen).bfloat16() for _ in range(2))
    out = backend.forward(q, k, v, cache, backend.prepare(md), 0.125)
    reference.write_kv(ref, k, v, md.slot_mapping)
    expected = reference.paged_attention(q, ref, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize("name", list(Q8))
def test_reference_8bit_attention_within_the_tolerance_table(name):
    """The table itself: the reference over its 8-bit cache vs over the exact values, on the
    conformance kit's batches and shapes."""
    cdt, tol = Q8[name], KV_CACHE_TOLERANCES[Q8[name]]
    backend = reference.ReferenceAttentionBackend()
    for heads, kv_heads, d in ((4, 4, 64), (8, 2, 128), (8, 1, 64)):
        for i, reqs in enumerate(batches(16).values()):
            _, expected, exact, _, _ = _run(backend, cdt, reqs, heads, kv_heads, d, seed=i)
            err = (expected - exact).abs()
            assert (err <= tol["atol"] + tol["rtol"] * exact.abs()).all(), f"max err {err.max():.3f}"


# ---- refusals --------------------------------------------------------------------------------


class _PlainPlatform(Platform):
    """A platform written before 8-bit caches: every default."""

    name = "plain"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls):
        return Availability.yes()

    @classmethod
    def device_info(cls):
        return DeviceInfo("plain", 1, 2**30, 2**30)

    @classmethod
    def attention_backend(cls, config):
        return reference.ReferenceAttentionBackend()


def _config(kv: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=""), cache=CacheConfig(kv_cache_dtype=kv))


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8"])
def test_a_platform_that_declares_no_8bit_cache_refuses_one(kv):
    with pytest.raises(ValueError, match=f"--kv-cache-dtype {kv} is not supported by the plain platform"):
        _PlainPlatform.check_and_update_config(_config(kv))
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        _PlainPlatform.check_and_update_config(_config("fp16"))
    assert _PlainPlatform.check_and_update_config(_config("auto")).cache.kv_cache_dtype == "auto"


def test_fp8_is_named_canonically_by_the_platform():
    from portside.backends.cpu.platform import CpuPlatform

    assert CpuPlatform.check_and_update_config(_config("fp8")).cache.kv_cache_dtype == "fp8_e4m3"


def test_the_runner_refuses_a_backend_that_does_not_list_the_dtype():
    from portside.runner.kv_cache import check_kv_cache_dtype

    class OldBackend(CpuAttentionBackend):  # as a plugin's backend written before 8-bit caches
        name = "old"
        kv_cache_dtypes = frozenset({"auto"})

    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8_e4m3: .* 'old' stores only \['auto'\]"):
        check_kv_cache_dtype("fp8", _PlainPlatform, OldBackend())
    check_kv_cache_dtype("auto", _PlainPlatform, OldBackend())
    check_kv_cache_dtype("int8", _PlainPlatform, CpuAttentionBackend())


def test_cpu_picks_an_8bit_capable_attention_and_refuses_ipex():
    from portside.backends.cpu.platform import CpuPlatform

    config = dataclasses.replace(CpuPlatform.check_and_update_config(_config("int8")), platform_options=())
    assert "int8" in CpuPlatform.attention_backend(config).kv_cache_dtypes
    ipex = dataclasses.replace(_config("int8"), platform_options=(("cpu_attention", "ipex"),))
    with pytest.raises(ValueError, match="ipex"):  # IPEX absent, or present and unable to store int8
        CpuPlatform.check_and_update_config(ipex)


# ---- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clear_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama drawn narrower than `tiny_llama` (init_std 0.1): attention scores of a few
    units, so an 8-bit cache moves its logits by < 0.11 (e5m2) while the first greedy tokens of
    PROMPTS[0] win by > 0.3 (measured)."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("clear_llama"), "llama", init_std=0.1)


PROMPTS = ([5, 17, 33, 9, 60, 12, 7], list(range(20, 60)))
ENGINE = dict(device="cpu", max_model_len=256, block_size=16, max_num_seqs=4)


def _greedy(llm, prompts, n: int = 8) -> list[list[int]]:
    from portside import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_engine_8bit_caches_generate_the_auto_tokens(clear_llama):
    from portside import LLM

    auto = _greedy(LLM(model=str(clear_llama), **ENGINE), PROMPTS[:1], 6)
    for kv in ("fp8", "fp8_e5m2", "int8"):
        llm = LLM(model=str(clear_llama), kv_cache_dtype=kv, **ENGINE)
        assert llm.engine.config.cache.kv_cache_dtype == kv_cache_dtype_name(kv)
        assert all(c.dtype == kv_cache_torch_dtype(kv, torch.float32) for c in llm.engine.executor.runner.kv_caches)
        assert _greedy(llm, PROMPTS[:1], 6) == auto, kv


@pytest.mark.parametrize("kv", list(Q8))
def test_engine_equals_the_reference_over_the_same_8bit_cache(clear_llama, kv):
    """The engine (native kernels, chunked prefill, block tables) gives exactly the greedy tokens
    of core's reference attention over an 8-bit cache of the same format."""
    from portside import LLM
    from portside.model.registry import load_model
    from portside.testing.paged import PagedSequence

    llm = LLM(model=str(clear_llama), kv_cache_dtype=kv, max_num_batched_tokens=16, **ENGINE)
    got = _greedy(llm, PROMPTS)
    model = load_model(ModelConfig(path=str(clear_llama)), CPU)
    backend = reference.ReferenceAttentionBackend()
    want = [PagedSequence(model, backend, 16, 128, cache_dtype=Q8[kv]).greedy(p, 8, prefill_chunk=16) for p in PROMPTS]
    assert got == want


def test_the_pool_holds_more_blocks_in_the_same_memory(clear_llama):
    from portside import LLM

    memory = 2**20  # bytes; the tiny model: 2 layers x 2 KV heads x head size 16, fp32
    engine = {**ENGINE, "max_num_seqs": 64}  # the pool is capped at 2 x max_num_seqs full-length sequences
    blocks = {kv: LLM(model=str(clear_llama), kv_cache_dtype=kv, kv_cache_memory=memory, **engine).engine.num_blocks
              for kv in ("auto", "fp8_e4m3", "int8")}  # fmt: skip
    per_block = {"auto": 2 * 2 * 2 * 16 * 4 * 16, "fp8_e4m3": 2 * 2 * 2 * 16 * 16, "int8": 2 * 2 * 2 * (16 + 4) * 16}
    assert blocks == {kv: memory // b for kv, b in per_block.items()}
    assert blocks["fp8_e4m3"] == 4 * blocks["auto"]


def _with_scales(src: Path, dst: Path, names: dict[str, torch.Tensor]) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.update(names)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales_are_loaded_and_applied_for_fp8(clear_llama, tmp_path):
    """k_scale / v_scale (and the older kv_scale, ModelOpt's k_proj.k_scale) as vLLM reads them:
    the fp8 cache holds k / k_scale and v / v_scale, and the model compensates, so logits stay
    within the fp8 cache's error of the auto cache; auto caches ignore them."""
    from portside.model.registry import load_model
    from portside.testing.paged import PagedSequence

    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(4.0),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor([2.0, 0.5]),  # one per KV head
        "model.layers.1.self_attn.q_scale": torch.tensor(3.0),  # fp8 attention math: skipped
    }
    path = _with_scales(clear_llama, tmp_path / "scaled", scales)
    model = load_model(ModelConfig(path=str(path)), CPU)
    attn = [model._layer(i).self_attn for i in range(2)]
    assert attn[0].k_scale.tolist() == [4.0, 4.0] and attn[0].v_scale.tolist() == [0.25, 0.25]
    assert attn[1].k_scale.tolist() == attn[1].v_scale.tolist() == [2.0, 0.5]
    backend = reference.ReferenceAttentionBackend()
    prompt = PROMPTS[1]
    plain = PagedSequence(model, backend, 16, 64)
    exact = plain.forward(prompt)  # auto cache: scales not applied
    model.use_kv_scales(True)
    assert all(a.kv_scaled for a in attn)
    fp8 = PagedSequence(model, backend, 16, 64, cache_dtype=torch.float8_e4m3fn)
    logits = fp8.forward(prompt)
    assert (logits - exact).abs().max() < 0.1
    slots = torch.tensor([plain.block_table[p // 16] * 16 + p % 16 for p in range(len(prompt))])
    k_plain, v_plain = reference.read_kv(plain.kv_caches[0], slots)
    k_fp8, v_fp8 = reference.read_kv(fp8.kv_caches[0], slots)
    assert ((k_fp8 - k_plain / 4).abs() <= kv_round_trip_bound(k_plain / 4, torch.float8_e4m3fn)).all()
    assert ((v_fp8 - v_plain / 0.25).abs() <= kv_round_trip_bound(v_plain / 0.25, torch.float8_e4m3fn)).all()
    model.use_kv_scales(False)
    assert not any(a.kv_scaled for a in attn)
    torch.testing.assert_close(PagedSequence(model, backend, 16, 64).forward(prompt), exact, atol=0, rtol=0)


def test_a_kv_scale_of_the_wrong_size_names_the_tensor(clear_llama, tmp_path):
    from portside.model.registry import load_model

    path = _with_scales(clear_llama, tmp_path / "bad", {"model.layers.0.self_attn.k_proj.k_scale": torch.ones(3)})
    with pytest.raises(ValueError, match="k_scale.*expected 1 or one per KV head"):
        load_model(ModelConfig(path=str(path)), CPU)


@pytest.mark.slow
def test_inductor_graphs_attend_over_an_8bit_cache_in_cpp(clear_llama, monkeypatch):
    """The inductor runner with an int8 cache: decode-only steps attend in C++ (the native decode
    plan over 8-bit caches: the Python backend sees prefill steps only), and the greedy tokens are
    the eager runner's."""
    from portside import LLM
    from portside.backends.cpu import native_ops

    if native_ops.unavailable_reason() is not None:
        pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}")
    eager = _greedy(LLM(model=str(clear_llama), kv_cache_dtype="int8", **ENGINE), PROMPTS)
    llm = LLM(model=str(clear_llama), kv_cache_dtype="int8", platform_options={"cpu_graph": "inductor"}, **ENGINE)
    assert llm.engine.executor.runner.graph_runner.name == "inductor"
    calls: list[bool] = []  # per Python attention call: was its step decode-only?
    forward = NativeAttentionBackend.forward

    def counting(self, query, key, value, kv_cache, metadata, scale, **features):
        calls.append(metadata.num_decode_tokens == query.shape[0])
        return forward(self, query, key, value, kv_cache, metadata, scale, **features)

    monkeypatch.setattr(NativeAttentionBackend, "forward", counting)
    assert _greedy(llm, PROMPTS) == eager
    assert calls and not any(calls)
