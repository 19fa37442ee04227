"""vLLM's engine flags mapped onto portside's: --gpu-memory-utilization (KV-cache sizing from the
device's memory query; host memory on cpu), --enforce-eager (each platform's eager options) and
--max-logprobs (a cap on what a request may ask for)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from portside.config import CacheConfig
from portside.contract import DeviceInfo
from portside.engine.args import EngineArgs
from portside.kv_cache.budget import kv_cache_budget
from portside.platform import resolve_platform

GiB = 2**30


def test_gpu_memory_utilization_is_a_share_of_total_memory_less_what_is_in_use() -> None:
    info = DeviceInfo(name="dev", count=1, total_memory=80 * GiB, free_memory=60 * GiB)  # 20 GiB in use
    assert kv_cache_budget(CacheConfig(gpu_memory_utilization=0.9), info, 0.9) == pytest.approx(0.9 * 80 * GiB - 20 * GiB)
    assert kv_cache_budget(CacheConfig(gpu_memory_utilization=1.0), info, 0.9) == pytest.approx(60 * GiB)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.2: 20% of dev's 80.0 GiB is 16.0 GiB, but 20.0 GiB is in use"):
        kv_cache_budget(CacheConfig(gpu_memory_utilization=0.2), info, 0.9)
    # without it, --kv-cache-memory and the platform default keep their meaning
    assert kv_cache_budget(CacheConfig(kv_cache_memory=0.5), info, 0.9) == pytest.approx(30 * GiB)
    assert kv_cache_budget(CacheConfig(), info, 4 * GiB) == pytest.approx(4 * GiB)


def test_gpu_memory_utilization_on_cpu_uses_host_memory(tiny_llama: Path) -> None:
    from portside.engine.llm_engine import LLMEngine

    cpu = resolve_platform("cpu")
    info = cpu.device_info()
    assert info.total_memory > 0 and 0 < info.free_memory <= info.total_memory
    in_use = (info.total_memory - info.free_memory) / info.total_memory
    if in_use < 0.01:
        pytest.skip("host memory almost unused: no fraction is too small to hold the weights")
    with pytest.raises(ValueError, match="is in use after loading the model"):
        LLMEngine(EngineArgs(model=str(tiny_llama), device="cpu", gpu_memory_utilization=in_use / 2, max_model_len=64))


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu_memory_utilization": 0.9, "kv_cache_memory": 2**30}, "pass one of them"),
    ({"gpu_memory_utilization": 0.0}, r"must be in \(0, 1\]"),
    ({"max_logprobs": -2}, "--max-logprobs must be -1"),
    ({"enforce_eager": True, "platform_options": {"cpu_graph": "inductor"}}, "--enforce-eager conflicts"),
])
def test_flag_conflicts(tiny_llama: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config(resolve_platform("cpu"))  # type: ignore[arg-type]


def test_enforce_eager_maps_to_each_platforms_eager_mode(tiny_llama: Path) -> None:
    cpu = resolve_platform("cpu")
    config = EngineArgs(model=str(tiny_llama), enforce_eager=True).create_engine_config(cpu)
    assert config.option("cpu_graph") == "eager"
    assert EngineArgs(model=str(tiny_llama)).create_engine_config(cpu).option("cpu_graph") is None
    # cuda / rocm: the option that skips CUDA/HIP graph capture (checked on the pure config step)
    from portside.backends.triton.gpu_platform import TorchGpuPlatform, update_gpu_config
    from portside.backends.triton.graphs import GRAPH_SIZES_OPTION

    assert TorchGpuPlatform.eager_options is not None
    gpu = dataclasses.replace(config, platform_options=tuple(TorchGpuPlatform.eager_options.items()))
    assert update_gpu_config(gpu, "cuda", True).option(GRAPH_SIZES_OPTION) == ""
    assert update_gpu_config(dataclasses.replace(config, platform_options=()), "cuda", True).option(GRAPH_SIZES_OPTION)


def test_max_logprobs_caps_requests(tiny_llama: Path) -> None:
    from portside.engine.llm import LLM
    from portside.sampling_params import SamplingParams

    with LLM(str(tiny_llama), device="cpu", max_model_len=64, num_kv_blocks=16, max_logprobs=25) as llm:
        out = llm.generate("hi", SamplingParams(max_tokens=2, logprobs=22), use_tqdm=False)  # past OpenAI's 20: allowed
        assert len(out[0].outputs[0].logprobs[0]) >= 22
        with pytest.raises(ValueError, match=r"logprobs: 26 requested, more than the 25 allowed"):
            llm.generate("hi", SamplingParams(max_tokens=2, logprobs=26), use_tqdm=False)
