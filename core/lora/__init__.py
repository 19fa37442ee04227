"""LoRA adapters: the per-request handle (`LoRARequest`, as vLLM names it) and the loader of the
adapters `peft` saves (`portside.lora.peft`, which imports torch: import it where it is needed,
so that `import portside` stays cheap)."""

from portside.lora.request import LoRARequest

__all__ = ["LoRARequest"]
