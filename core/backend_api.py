"""Deprecated: the contract's old single module. Import from `portside.contract` instead.

Every name this module had still resolves, to the same object as in `portside.contract`, with a
`DeprecationWarning` naming the new path; this shim is removed in the release after 0.1.
"""

# ruff: noqa: F822  (the names of `__all__` are served by the module `__getattr__`)
from __future__ import annotations

import warnings
from typing import Any

import portside.contract as _contract

# the names the old module had: the contract's, less those added with the split
_ADDED = ("BackendOption", "BatchInvariantAttention", "check_backend_options", "EncoderAttention", "ENCODER_ATTENTION_FEATURES", "QuantWeight", "QuantParts", "pack_int4",
          "unpack_int4", "quantize_activation", "release_free_memory", "RecurrentKernels", "RecurrentMetadata",
          "RECURRENT_KERNELS", "kernels_for",
          "StateSpec", "LatentAttention", "LatentKVCacheSpec", "reference_encoder_attention",
          "KVBlockIO", "KVBlockLayout", "NEUTRAL_ELEMENT_ORDER", "LATENT_ELEMENT_ORDER")
__all__ = [name for name in _contract.__all__ if name not in _ADDED]

# importable from the old module though not in its `__all__`
_ALSO = ("EncoderAttention",)


def __getattr__(name: str) -> Any:
    if name in __all__ or name in _ALSO:
        warnings.warn(
            f"portside.backend_api is deprecated and will be removed after portside 0.1; "
            f"import {name} from portside.contract",
            DeprecationWarning,
            stacklevel=2,  # the importing module's line
        )
        return getattr(_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_ALSO])
