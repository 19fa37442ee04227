"""The rocm backend (AMD): Triton paged attention, HIP graphs, RCCL.

Registered through the `portside.platforms` entry point like any plugin. `register()` imports
nothing heavy (no triton, no HIP initialisation); `RocmPlatform.is_available()` says why the
platform cannot run here, so it always returns the class path.
"""


def register() -> str:
    return "portside.backends.rocm.platform:RocmPlatform"
