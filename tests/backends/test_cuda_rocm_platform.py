"""cuda and rocm platform logic on CPU: probes, config hook, graph buckets and padding, collectives.

The GPU-only parts (graph capture and replay, NCCL) run in ci/gpu_check.sh on a lent GPU.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from portside.backends.cuda.communicator import NcclCommunicator
from portside.backends.cuda.graph import CudaGraphRunner
from portside.backends.cuda.platform import CudaPlatform, cuda_build_error
from portside.backends.rocm.communicator import RcclCommunicator
from portside.backends.rocm.graph import HipGraphRunner
from portside.backends.rocm.platform import RocmPlatform, rocm_build_error
from portside.backends.triton.gpu_platform import gpu_availability, update_gpu_config
from portside.backends.triton.graphs import (
    DeviceGraphRunner,
    default_graph_sizes,
    is_decode_only,
    parse_graph_sizes,
    select_bucket,
)
from portside.backends.triton.launch import ArchInfo, choose_attention_launch, choose_num_splits
from portside.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from portside.contract import (
    AttentionMetadata,
    ForwardContext,
    GraphCaptureSupport,
    SingleRankCommunicator,
)

NO_GPU = not torch.cuda.is_available()


def make_config(dtype: torch.dtype = torch.float32, max_num_seqs: int = 128, **options: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path="unused", dtype=dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        platform_options=tuple(options.items()),
    )


# ---- registration and probes -------------------------------------------------------------------


def test_entry_points_resolve_to_cheap_register() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="portside.platforms")}
    assert eps["cuda"].load()() == "portside.backends.cuda.platform:CudaPlatform"
    assert eps["rocm"].load()() == "portside.backends.rocm.platform:RocmPlatform"


def test_register_and_probe_import_no_triton_and_do_not_init_cuda() -> None:
    code = (
        "import sys, torch\n"
        "import portside.backends.cuda as c, portside.backends.rocm as r\n"
        "from importlib import import_module\n"
        "for reg in (c.register, r.register):\n"
        "    mod, cls = reg().split(':')\n"
        "    getattr(import_module(mod), cls).is_available()\n"
        "assert 'triton' not in sys.modules, 'probe imported triton'\n"
        "assert not torch.cuda.is_initialized(), 'probe initialised CUDA'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU-only answer")
def test_probes_say_unavailable_here_with_a_reason() -> None:
    cuda, rocm = CudaPlatform.is_available(), RocmPlatform.is_available()
    assert not cuda and not rocm
    if torch.version.cuda is None and torch.version.hip is None:
        assert cuda.reason == "this torch build has no CUDA support (CPU-only wheel)"
        assert "no ROCm support" in rocm.reason


def test_build_checks() -> None:
    assert cuda_build_error(None, None) == "this torch build has no CUDA support (CPU-only wheel)"
    assert "ROCm" in (cuda_build_error(None, "6.2.41133") or "")  # a ROCm build is not cuda
    assert cuda_build_error("12.8", None) is None
    assert rocm_build_error(None) and rocm_build_error("6.2.41133") is None


def test_availability_decision_order() -> None:
    assert gpu_availability("bad build", True, 8, "none").reason == "bad build"
    assert "triton is not installed" in gpu_availability(None, False, 8, "none").reason
    assert gpu_availability(None, True, 0, "no NVIDIA GPU visible").reason == "no NVIDIA GPU visible"
    assert gpu_availability(None, True, 2, "none")


def test_identity() -> None:
    assert (CudaPlatform.name, CudaPlatform.device_type, CudaPlatform.dist_backend) == ("cuda", "cuda", "nccl")
    assert (RocmPlatform.name, RocmPlatform.device_type, RocmPlatform.dist_backend) == ("rocm", "cuda", "nccl")
    for p in (CudaPlatform, RocmPlatform):
        assert p.priority > 0 and p.block_sizes == (16, 32, 64)
    assert CudaPlatform.describe() == {"attention": "triton", "graph": "cuda-graphs", "collectives": "nccl"}
    assert RocmPlatform.describe() == {"attention": "triton", "graph": "hip-graphs", "collectives": "rccl"}


def test_attention_backend_is_triton() -> None:
    pytest.importorskip("triton")
    backend = CudaPlatform.attention_backend(make_config())
    assert backend.name == "triton" and backend.graph_support is GraphCaptureSupport.DECODE_ONLY
    assert backend.supports(64, torch.bfloat16, 16) is None
    assert "head size 72" in (backend.supports(72, torch.float16, 16) or "")
    assert "block size 8" in (backend.supports(64, torch.float16, 8) or "")


# ---- configuration hook ------------------------------------------------------------------------


def test_check_and_update_config_defaults() -> None:
    config = CudaPlatform.check_and_update_config(make_config(max_num_seqs=48))
    assert config.cache.block_size == 16
    assert config.option("graph_sizes") == "1,2,4,8,16,32,48"
    with pytest.raises(ValueError, match="block size 8"):
        RocmPlatform.check_and_update_config(
            EngineConfig(model=ModelConfig(path="x"), cache=CacheConfig(block_size=8))
        )


def test_config_graph_options_and_rejections() -> None:
    assert update_gpu_config(make_config(enforce_eager="1"), "cuda", True).option("graph_sizes") == ""
    custom = update_gpu_config(make_config(max_num_seqs=8, graph_sizes="4,1,16,2"), "cuda", True)
    assert custom.option("graph_sizes") == "1,2,4"  # sorted, above max_num_seqs dropped
    with pytest.raises(ValueError, match=r"unknown cuda backend option\(s\) \['cpu_graph'\]; it takes graph_sizes, "
                                         "enforce_eager"):
        CudaPlatform.check_and_update_config(make_config(cpu_graph="inductor"))
    with pytest.raises(ValueError, match=r"cuda backend option enforce_eager='on': use one of \['0', '1', 'false', "):
        CudaPlatform.check_and_update_config(make_config(enforce_eager="on"))
    with pytest.raises(ValueError, match="does not support bfloat16; use dtype float16"):
        update_gpu_config(make_config(dtype=torch.bfloat16), "rocm", bf16_supported=False)
    assert update_gpu_config(make_config(dtype=torch.bfloat16), "cuda", bf16_supported=True).model.dtype == torch.bfloat16


# ---- graph buckets and padding -----------------------------------------------------------------


def test_bucket_sizes_and_selection() -> None:
    assert default_graph_sizes(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert default_graph_sizes(1) == (1,)
    assert default_graph_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert default_graph_sizes(4096)[-1] == 512
    sizes = (1, 2, 4, 8)
    assert [select_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 0)] == [1, 2, 4, 8, 8, None, None]
    assert parse_graph_sizes(" 8, 1,2,2 ") == (1, 2, 8) and parse_graph_sizes("") == ()
    with pytest.raises(ValueError):
        parse_graph_sizes("1,x")
    with pytest.raises(ValueError):
        parse_graph_sizes("0,4")


def _metadata(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.arange(qsl[-1]),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 4, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=16,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


def test_graph_runner_without_capture_runs_eagerly() -> None:
    calls = []

    def model_fn(ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        calls.append(ids)
        return ids.float()[:, None] * 2

    config = update_gpu_config(make_config(max_num_seqs=8), "cuda", True)
    runner = CudaPlatform.graph_runner(model_fn, config)
    assert isinstance(runner, CudaGraphRunner) and isinstance(RocmPlatform.graph_runner(model_fn, config), HipGraphRunner)
    assert runner.sizes == (1, 2, 4, 8)
    decode = _metadata([1, 1, 1], [5, 6, 7])
    mixed = _metadata([1, 3], [5, 9])
    assert is_decode_only(decode) and not is_decode_only(mixed)
    ctx = ForwardContext(backend=None, kv_caches=[], metadata=decode)  # type: ignore[arg-type]
    assert runner.bucket_for(ctx) is None  # nothing captured
    out = runner(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), ctx)
    assert out.tolist() == [[2.0], [4.0], [6.0]] and len(calls) == 1
    assert DeviceGraphRunner(model_fn, make_config(), sizes=()).sizes == ()


# ---- launch heuristics -------------------------------------------------------------------------


def test_launch_heuristics_per_architecture() -> None:
    h200 = ArchInfo(vendor="nvidia", num_sms=132, capability=(9, 0))
    mi300 = ArchInfo(vendor="amd", num_sms=304, warp_size=64, arch_name="gfx942")
    for arch in (h200, mi300):
        for head in (64, 80, 96, 128, 256):
            for gqa in (1, 3, 4, 8):
                for q_len in (1, 512):
                    launch = choose_attention_launch(arch, head, gqa, q_len, torch.float16)
                    assert launch.block_m >= 16 and launch.block_m & (launch.block_m - 1) == 0
    amd = choose_attention_launch(mi300, 128, 4, 1, torch.float16)
    assert dict(amd.extra).get("waves_per_eu") and amd.num_stages == 1 and amd.input_precision == "ieee"
    nv = choose_attention_launch(h200, 128, 4, 512, torch.float16)
    assert nv.block_m == 64 and nv.extra == () and nv.input_precision == "tf32"
    assert choose_attention_launch(h200, 128, 4, 1, torch.float32).input_precision == "ieee"
    # split-KV: only for decode-only batches with long contexts that leave SMs idle
    assert choose_num_splits(h200, 1, 8, 1, 8192, 16) > 1
    assert choose_num_splits(h200, 64, 8, 1, 8192, 16) == 1  # grid already fills the GPU
    assert choose_num_splits(h200, 1, 8, 1, 100, 16) == 1  # short context
    assert choose_num_splits(h200, 1, 8, 7, 8192, 16) == 1  # prefill in the batch


# ---- collectives -------------------------------------------------------------------------------


def test_communicator_without_distributed_is_single_rank() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    assert isinstance(CudaPlatform.communicator(), SingleRankCommunicator)
    assert isinstance(RocmPlatform.communicator(), SingleRankCommunicator)


def _collectives_worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for platform, cls in ((CudaPlatform, NcclCommunicator), (RocmPlatform, RcclCommunicator)):
            comm = platform.communicator()
            assert type(comm) is cls and (comm.rank, comm.world_size) == (rank, world_size)
            x = torch.full((3,), float(rank + 1))
            assert comm.all_reduce(x).tolist() == [3.0, 3.0, 3.0]
            gathered = comm.all_gather(torch.tensor([[rank]]), dim=1)
            assert gathered.tolist() == [[0, 1]]
            b = comm.broadcast(torch.tensor([rank * 10 + 7]), src=1)
            assert b.tolist() == [17]
            comm.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_communicators_over_gloo_two_ranks() -> None:
    """The NCCL/RCCL communicators' wiring, checked over gloo (no NCCL here) with two processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_collectives_worker, args=(2, port), nprocs=2, join=True, start_method="spawn")
