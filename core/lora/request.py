"""`LoRARequest`: which adapter a request runs with, named as vLLM names it
(`vllm.lora.request.LoRARequest`), so that code written for vLLM runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoRARequest"]


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter for one request.

    `lora_int_id` (>= 1) identifies the adapter: two requests with the same id share one loaded
    copy, so the id must be unique per adapter (as in vLLM, this is not checked against the
    path). Equality and hashing go by `lora_int_id` alone. `lora_path` is the folder `peft`'s
    `save_pretrained` wrote; `base_model_name` is the model it was trained on (the parent that
    `/v1/models` lists).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)
