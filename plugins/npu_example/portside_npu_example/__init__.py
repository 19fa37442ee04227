"""portside-npu-example: a third-party portside backend that registers the device `npu-example`.

The "NPU" is simulated on the CPU, but every part is the plugin's own and is written only
against `portside.backend_api`:

- `attention.py`: paged attention over a block-major cache layout
  ``[num_blocks, 2, num_kv_heads, block_size, head_size]`` (not core's canonical one);
- `graph.py`: a runner that "captures" fixed decode batch sizes and pads batches to them;
- `communicator.py`: collectives through torch.distributed (gloo here; HCCL-like on a real NPU).

This module is imported by discovery on every `portside` start, so it must stay cheap: no torch,
no vendor runtime. `register()` only says where the platform class lives.
"""

from __future__ import annotations

import os

# VENDOR: an env switch to hide the device is handy for CI; a real plugin may instead check for
# its driver library here (a file test, never a runtime initialisation) and return None.
DISABLE_ENV = "PORTSIDE_NPU_EXAMPLE_DISABLE"


def register() -> str | None:
    """Entry point of group ``portside.platforms``: the platform class path, or None when this
    package knows at once that it cannot run here."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    return "portside_npu_example.platform:NpuExamplePlatform"
