"""The engine's side of LoRA: each adapter (by `lora_int_id`) is checked once, when a request
first names it, so a bad adapter is the request's ValueError and never a failed model step."""

from __future__ import annotations

from typing import Any

from portside.config import LoRAConfig


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, model_path: str) -> None:
        self.config = config
        self.model_path = model_path
        self._known: dict[int, Any] = {}  # lora_int_id -> the LoRARequest first seen with it
        self._targets: Any = None  # the served model's LoRATargets, built on first use (meta device)

    def check(self, lora_request: Any) -> None:
        """ValueError naming the problem unless `lora_request` (None: none) can run."""
        if lora_request is None:
            return
        if self.config is None:
            raise ValueError("lora_request: LoRA adapters are not enabled; start the engine with enable_lora=True (--enable-lora)")
        from portside.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a portside.LoRARequest, got {type(lora_request).__name__}")
        known = self._known.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already the adapter {known.lora_name!r} at "
                                 f"{known.lora_path!r}; give {lora_request.lora_path!r} another id")
            return
        from portside.lora.peft import load_peft_adapter
        from portside.lora.targets import LoRATargets

        if self._targets is None:
            self._targets = LoRATargets.for_folder(self.model_path)
        load_peft_adapter(lora_request.lora_path, max_rank=self.config.max_lora_rank, targets=self._targets)
        self._known[lora_request.lora_int_id] = lora_request

    def forget(self, lora_int_id: int) -> None:
        self._known.pop(lora_int_id, None)
