"""Weights that change while the engine runs (reinforcement learning): in-place updates from
Hugging Face-named tensors, and sleeping (weights offloaded or discarded, the KV cache dropped).

An update goes through the model's own `load_weights`, the loader's mapping from checkpoint
names to parameters (fused qkv and gate_up, stacked experts, this rank's tensor-parallel slice,
this pipeline stage's layers), twice: first against meta stand-ins of every parameter and buffer
(`_dry_run`: names, shapes and dtypes are checked, nothing is written), then for real. So a bad
tensor anywhere in an update raises ValueError naming it, and the model is unchanged.

`RunnerWeights` is mixed into `ModelRunner`: `update_weights`, `update_weights_from_path`,
`sleep`, `wake_up`. Whatever a graph runner built over the weights (compiled graphs whose
weights are constants, prepacked copies, pointers into them) is rebuilt before the next step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portside.contract.memory import release_free_memory

__all__ = ["RunnerWeights", "update_model_weights", "check_updatable", "check_weights"]

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


def check_updatable(model: nn.Module) -> None:
    """ValueError for a model whose weights cannot be updated in place (quantized layers)."""
    for name, module in model.named_modules():
        if getattr(module, "quant", None) is not None:
            raise ValueError(f"layer {name!r} is quantized: in-place weight updates need full-precision weights "
                             "(serve the unquantized checkpoint to update it, or restart the engine on the new one)")
    if not hasattr(model, "load_weights"):
        raise ValueError(f"{type(model).__name__} has no load_weights: its weights cannot be updated in place")


def check_weights(model: nn.Module, items: list[Any], cast: bool = False) -> None:
    """ValueError naming the first tensor `update_model_weights` would refuse (tensors may be
    meta tensors: only names, shapes and dtypes are read)."""
    check_updatable(model)
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weights[{i}]: expected a (Hugging Face parameter name, tensor) pair, got {_describe(item)}")
    with _dry_run(model, check_dtype=not cast):
        model.load_weights(iter(items))  # type: ignore[operator]


def update_model_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], cast: bool = False) -> int:
    """Copy Hugging Face-named tensors into `model` (see the module docstring); all or nothing.
    `cast`: a tensor of another floating dtype is converted (as loading a checkpoint does);
    otherwise its dtype must be the parameter's. Returns how many tensors were given."""
    items = list(weights)
    check_weights(model, items, cast)
    with torch.no_grad():
        model.load_weights((n, t.detach()) for n, t in items)  # type: ignore[operator]
    return len(items)


def _describe(item: Any) -> str:
    if isinstance(item, (tuple, list)):
        return "(" + ", ".join(type(x).__name__ for x in item) + ")"
    return type(item).__name__


class _CheckCopies(torch.overrides.TorchFunctionMode):
    """During a dry run: a tensor copied into a meta stand-in must have the stand-in's dtype
    (what a real copy would silently convert)."""

    def __init__(self, check_dtype: bool) -> None:
        super().__init__()
        self.check_dtype = check_dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_ and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and dst.is_meta and src.dtype != dst.dtype:
                if not src.is_floating_point() and dst.is_floating_point():
                    raise ValueError(f"has dtype {src.dtype}; the parameter is {dst.dtype}")
                if self.check_dtype:
                    raise ValueError(f"has dtype {src.dtype}; the parameter is {dst.dtype} (convert it with "
                                     f".to({dst.dtype}))")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _dry_run(model: nn.Module, check_dtype: bool) -> Iterator[None]:
    """Every parameter and buffer of `model` replaced by a meta tensor of its shape and dtype
    (with its attributes: `weight_loader`, `shard_ids`, ...), restored on exit."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    stand_ins: dict[int, Any] = {}  # tied tensors stay tied
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in stand_ins:
                        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, nn.Parameter):
                            meta = nn.Parameter(meta, requires_grad=False)
                            meta.__dict__.update(t.__dict__)
                        stand_ins[id(t)] = meta
                    swapped.append((table, key, t))
                    table[key] = stand_ins[id(t)]
        with _CheckCopies(check_dtype):
            yield
    finally:
        for table, key, t in swapped:
            table[key] = t


class RunnerWeights:
    """Mixed into `ModelRunner` (which provides model, platform, config, kv_caches, ...)."""

    model: Any
    platform: Any
    config: Any
    kv_caches: list[torch.Tensor]
    states: Any
    draft: Any
    _offloaded: Any = None  # what Platform.offload_weights returned while the weights sleep
    _weights_asleep = False
    _kv_asleep = False
    _graphs_stale = False  # rebuild the graph runners before the next step
    _num_blocks = 0
    _transfer: Any = None  # the weight-update group this rank joined (`init_weight_transfer`)
    graph_runner: Any
    eager_runner: Any

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], cast: bool = False) -> int:
        """Copy Hugging Face-named tensors into this rank's shard (`update_model_weights`)."""
        if self._weights_asleep:
            raise ValueError("the weights are asleep: wake_up(tags=['weights']) before updating them")
        n = update_model_weights(self.model, weights, cast=cast)
        self._graphs_stale = True
        return n

    def update_weights_from_path(self, path: str) -> int:
        """Every tensor of the safetensors checkpoint in folder `path` (dtypes converted as at load)."""
        from portside.model.loader import iterate_safetensors

        if not Path(path).is_dir():
            raise ValueError(f"update_weights_from_path: {path!r} is not a folder")
        try:
            tensors = list(iterate_safetensors(path))
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        try:
            return self.update_weights(tensors, cast=True)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def init_weight_transfer(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join a trainer's weight-update group as member `rank_offset` + this rank
        (`portside.distributed.weight_transfer`); blocks until every member has joined."""
        from portside.distributed.weight_transfer import WeightTransferGroup

        self._transfer = WeightTransferGroup(host, port, rank_offset + self.rank, world_size)  # type: ignore[attr-defined]

    def close_weight_transfer(self) -> None:
        """Leave the weight-update group (with every other member: `WeightTransferGroup.close`)."""
        group = getattr(self, "_transfer", None)
        if group is not None:
            self._transfer = None
            group.close()

    def receive_weights(self) -> int:
        """The trainer's next broadcast into this rank's shard (checked before any tensor moves)."""
        group = getattr(self, "_transfer", None)
        if group is None:
            raise ValueError("no weight-update group: call init_weight_transfer first")

        def check(items: list[tuple[str, torch.Tensor]]) -> None:
            if self._weights_asleep:
                raise ValueError("the weights are asleep: wake_up(tags=['weights']) before updating them")
            check_weights(self.model, items)

        return self.update_weights(group.receive(check))

    def sleep(self, level: int) -> None:
        """Level 1: the weights offloaded (`Platform.offload_weights`, kept), the KV cache dropped;
        level 2: both dropped (weights come back undefined, for an update to fill)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.draft is not None:
            raise ValueError("sleep is not supported with a draft model (speculative decoding)")
        self._drop_graphs()
        if not self._kv_asleep:
            self._num_blocks = self.scratch_block  # type: ignore[attr-defined]
            self.kv_caches, self.states = [], None
            self.kv_transfer.release()  # type: ignore[attr-defined]  # it holds the caches and the host tier
            self._kv_asleep = True
        if not self._weights_asleep:
            self._offloaded = self.platform.offload_weights(self.model, keep=level == 1)
            self._weights_asleep = True
        release_free_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (None: both)."""
        for tag in tags or TAGS:
            if tag == WEIGHTS and self._weights_asleep:
                self.platform.restore_weights(self.model, self._offloaded)
                self._offloaded, self._weights_asleep = None, False
            elif tag == KV_CACHE and self._kv_asleep:
                self._allocate_kv(self._num_blocks)  # type: ignore[attr-defined]
                self._kv_asleep = False
        self._graphs_stale = True

    def _drop_graphs(self) -> None:
        """Let go of what the graph runners built over the weights and the KV cache (packed
        copies, compiled constants); an eager stand-in until the next step rebuilds them."""
        from portside.contract import EagerGraphRunner

        self.graph_runner = self.eager_runner = EagerGraphRunner(self.model, self.config)
        self._graphs_stale = True

    def _rebuild_graphs(self) -> None:
        """Before a step after weights changed: the platform's graph runners, captured again."""
        if self._weights_asleep or self._kv_asleep:
            raise RuntimeError("the model runner is asleep: wake_up() before running a step")
        self._setup_graph_runners()  # type: ignore[attr-defined]
        with self.platform.inference_mode():
            self.graph_runner.capture(self._dummy_decode_context)  # type: ignore[attr-defined]
        self._graphs_stale = False
