"""The model runner's adapters: loaded on first use into a host cache (LRU, `max_cpu_loras`),
copied into one of `max_loras` device slots when a batch needs them (a free slot, else the least
recently used one the batch does not need), and turned into the step's token -> slot mapping.

Every tensor-parallel rank runs the same steps on the same scheduler output, so every rank
makes the same slot choices without talking to the others.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from portside.config import LoRAConfig
from portside.lora.layers import LoRALayer, LoRAState
from portside.lora.targets import LoRATargets

logger = logging.getLogger(__name__)

# module name -> part -> this rank's (A [r, in_local], B [rows_local, r]), scaling folded in
Resolved = dict[str, dict[object, tuple[torch.Tensor, torch.Tensor]]]


class LoRAModelManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, ops: Any) -> None:
        self.model = model
        self.config = config
        self.state = LoRAState(ops)
        self.targets = LoRATargets(model)  # the attention and MLP projections, as adapters name them
        self.layers: dict[str, LoRALayer] = {
            name: LoRALayer.attach(m, self.state, config.max_loras, config.max_lora_rank)
            for name, m in self.targets.layers.items()
        }
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear layer LoRA adapters can target")
        self._host: OrderedDict[int, Resolved] = OrderedDict()  # lora id -> weights, LRU first
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora id -> device slot, LRU first
        self._dtype = next(iter(self.layers.values())).a.dtype

    def resolve(self, lora_request: Any) -> Resolved:
        """An adapter's weights as this rank's layers take them (ValueError naming what is wrong)."""
        from portside.lora.peft import load_peft_adapter

        adapter = load_peft_adapter(lora_request.lora_path, max_rank=self.config.max_lora_rank, dtype=self._dtype,
                                    targets=self.targets)
        resolved: Resolved = {}
        for hf_name, (a, b) in adapter.weights.items():
            for target, part, b_part in self.model.checkpoint_tensors(hf_name + ".weight", b):  # type: ignore[operator]
                module = target.removesuffix(".weight")
                layer = self.layers.get(module)
                if layer is None:
                    raise ValueError(f"{lora_request.lora_path}: {hf_name} is not a layer portside applies LoRA to "
                                     f"(LoRA covers the attention and MLP projections)")
                try:
                    resolved.setdefault(module, {})[part] = layer.shard(part, a, b_part)
                except ValueError as e:
                    raise ValueError(f"{lora_request.lora_path}: {hf_name}: {e} (an adapter for another model?)") from None
        return resolved

    def _host_weights(self, lora_request: Any) -> Resolved:
        lid = lora_request.lora_int_id
        if lid in self._host:
            self._host.move_to_end(lid)
            return self._host[lid]
        weights = self.resolve(lora_request)
        self._host[lid] = weights
        while len(self._host) > self.config.host_capacity:
            self._host.popitem(last=False)
        return weights

    def _slot(self, lora_request: Any, needed: set[int]) -> int:
        lid = lora_request.lora_int_id
        if lid in self._slots:
            self._slots.move_to_end(lid)
            return self._slots[lid]
        # read first: an adapter that cannot be read (its folder gone since it left the host
        # cache) fails the step with the slot table as it was, every listed slot still filled
        weights = self._host_weights(lora_request)
        free = sorted(set(range(self.config.max_loras)) - set(self._slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next((v for v in self._slots if v not in needed), None)
            if victim is None:
                raise RuntimeError(f"a batch needs more than max_loras={self.config.max_loras} adapters")
            slot = self._slots.pop(victim)
        for name, layer in self.layers.items():
            layer.write_slot(slot, weights.get(name, {}))
        self._slots[lid] = slot
        logger.debug("LoRA adapter %s (id %d) in slot %d", lora_request.lora_name, lid, slot)
        return slot

    def set_batch(self, loras: Sequence[Any], num_tokens: Sequence[int], device: torch.device) -> None:
        """Map the step's tokens (requests in batch order, `num_tokens` each) to their adapters'
        slots; a batch without adapters computes no LoRA term at all."""
        if not any(lr is not None for lr in loras):
            self.state.mapping = None
            return
        from portside.ops.lora import LoRAMapping

        needed = {lr.lora_int_id for lr in loras if lr is not None}
        slots = [self._slot(lr, needed) if lr is not None else -1 for lr in loras]
        per_token = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), torch.tensor(list(num_tokens)))
        self.state.mapping = LoRAMapping(token_slots=per_token.to(device), num_slots=self.config.max_loras)

    def clear(self) -> None:
        self.state.mapping = None
