"""What `--batch-invariant` (`EngineArgs.batch_invariant`) refuses up front, with the fix named:
a platform that does not declare `Platform.supports_batch_invariant`, the features whose
kernels are not batch-invariant (LoRA adapters, quantized weights, speculative decoding), and
tensor parallelism over more than two ranks. The
model's layers are checked when it is loaded (`portside.model.batch_invariant`).
"""

from __future__ import annotations

from portside.config import EngineConfig
from portside.contract import Platform

__all__ = ["check_batch_invariant"]


def check_batch_invariant(config: EngineConfig, platform: type[Platform]) -> None:
    """Raise ValueError when batch-invariant mode cannot run with `config` on `platform`."""
    if not config.batch_invariant:
        return
    if not platform.supports_batch_invariant:
        raise ValueError(f"--batch-invariant is not supported by the {platform.name} platform (its kernels' "
                         "results depend on the batch); run it on a platform that supports it (cpu) or drop the flag")
    refused = [
        ("--enable-lora", config.lora is not None),
        ("--quantization (a quantized checkpoint)", config.model.quantization is not None),
        ("--speculative-config", config.speculative is not None),
    ]
    if config.parallel.tensor_parallel_size > 2:  # a + b is exact either way round; (a + b) + c is not
        raise ValueError("--batch-invariant supports --tensor-parallel-size 1 or 2: summing the partial results of "
                         "more ranks, the collective's chunking (which follows the batch's size) reorders the sum")
    for flag, used in refused:
        if used:
            raise ValueError(f"--batch-invariant does not support {flag}: its kernels are not batch-invariant; "
                             "drop one of them")
