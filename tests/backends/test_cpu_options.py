"""The cpu backend's dispatch table (`backends/cpu/options.py`, issue 44): the attention path, graph
mode and linear mode chosen once per configuration from the backend options, the dtypes, the
CPU's flags and the native library's state, logged at start-up in one line, and what the
platform's parts are built from."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from portside.backends.cpu import native_ops, options
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.host import has_amx_bf16, has_native_bf16
from portside.backends.cpu.ipex_attention import ipex_unavailable_reason
from portside.backends.cpu.kernels import native_unavailable_reason
from portside.backends.cpu.platform import CpuPlatform
from portside.config import CacheConfig, EngineConfig, ModelConfig

NATIVE = native_unavailable_reason() is None
IPEX = ipex_unavailable_reason() is None


def _config(dtype: torch.dtype = torch.float32, kv: str = "auto", **opts: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", dtype=dtype), cache=CacheConfig(kv_cache_dtype=kv),
                        platform_options=tuple(sorted(opts.items())))


def test_defaults_are_the_declared_ones() -> None:
    chosen = options.cpu_options(_config())
    declared = {o.name: o.default for o in CpuPlatform.backend_options}
    assert chosen.graph == declared["cpu_graph"] == "eager"
    assert (chosen.fused_decode, chosen.prepack, chosen.kv_prefault) == (True, True, True)
    assert chosen.allocator_cache_mb == int(declared["cpu_allocator_cache_mb"]) and chosen.threads is None


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native kernels do not build here")
@pytest.mark.parametrize("dtype, kv, impl, expected", [
    (torch.float32, "auto", "auto", "ipex" if IPEX else "native"),
    (torch.bfloat16, "auto", "auto", "ipex" if IPEX else "native"),
    (torch.float32, "int8", "auto", "native"),  # IPEX stores only the model's dtype
    (torch.float16, "auto", "auto", "ipex" if IPEX else "torch"),  # the native kernels are fp32 / bf16
    (torch.float32, "auto", "torch", "torch"),
    (torch.float16, "auto", "native", "native"),  # forced (fp16 steps fall back call by call)
])
def test_the_attention_path(dtype: torch.dtype, kv: str, impl: str, expected: str) -> None:
    chosen = options.cpu_options(_config(dtype, kv, cpu_attention=impl))
    assert chosen.attention == expected and chosen.native == "loaded"
    backend = CpuPlatform.attention_backend(_config(dtype, kv, cpu_attention=impl))
    assert type(backend) is {"native": NativeAttentionBackend, "torch": CpuAttentionBackend}.get(expected, type(backend))


def test_the_bf16_linear_mode_by_the_cpus_flags_and_the_library() -> None:
    other = "native" if has_native_bf16() else "widen"
    assert options._bf16_linears("auto", "unavailable") == other
    assert options._bf16_linears("auto", "building") == ("amx" if has_amx_bf16() else other)  # verified once built
    assert options._bf16_linears("widen", "loaded") == "widen"
    if NATIVE:
        want = "amx" if native_ops.amx_unavailable_reason(wait=False) is None else other
        assert options.cpu_options(_config(torch.bfloat16)).bf16_linears == want


def test_chosen_once_per_configuration_and_again_when_the_library_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(cpu_prepack="off", cpu_threads="1")
    first = options.cpu_options(config)
    assert options.cpu_options(dataclasses.replace(config)) is first  # an equal configuration: the same choice
    assert options.cpu_options(_config(cpu_prepack="on", cpu_threads="1")) is not first
    assert (first.prepack, first.threads) == (False, 1)
    monkeypatch.setattr(native_ops, "status", lambda: "unavailable" if first.native == "loaded" else "loaded")
    assert options.cpu_options(config) is not first  # the library's state moved: chosen anew


def test_numbers_are_checked() -> None:
    with pytest.raises(ValueError, match="cpu_threads='two': give a positive integer"):
        options.cpu_options(_config(cpu_threads="two"))
    with pytest.raises(ValueError, match="cpu_allocator_cache_mb='lots': give a size in MiB"):
        CpuPlatform.check_and_update_config(_config(cpu_allocator_cache_mb="lots"))


def test_one_start_up_line_names_the_choice(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    from portside.engine.llm import LLM

    with caplog.at_level(logging.INFO, logger="portside.backends.cpu"), LLM(
            model=str(tiny_llama), device="cpu", max_model_len=64, num_kv_blocks=16,
            platform_options={"cpu_prepack": "off", "cpu_kv_prefault": "off"}) as llm:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu: dtype")]
        assert len(lines) == 1, lines
        assert "graph eager, attention " in lines[0] and "prepacked linears off" in lines[0]
        assert "KV prefault off" in lines[0]
        runner = llm.engine.executor.runner
        chosen = options.cpu_options(runner.config)
        assert runner.graph_runner.packed_weights is None and not runner.attn_backend.prefault_host_cache
        names = {"native": "native-paged", "torch": "torch-sdpa", "ipex": "ipex-paged"}
        assert runner.attn_backend.name == names[chosen.attention]
