"""Backend tests: without a GPU, Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any `@triton.jit` decorator runs, i.e. before a kernel
module is imported; pytest imports this conftest before the test modules of this folder.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else CPU (interpreter)."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")
