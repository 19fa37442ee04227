"""The cuda backend (NVIDIA): Triton paged attention, CUDA graphs, NCCL.

Registered through the `portside.platforms` entry point like any plugin. `register()` imports
nothing heavy (no triton, no CUDA initialisation); `CudaPlatform.is_available()` says why the
platform cannot run here, so it always returns the class path.
"""


def register() -> str:
    return "portside.backends.cuda.platform:CudaPlatform"
