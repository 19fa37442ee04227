"""What reinforcement-learning frameworks ask of a running engine, as vLLM exposes it: weight
updates in place (`update_weights`, `update_weights_from_path`, `collective_rpc`), sleeping
(`sleep`, `wake_up`, `is_sleeping`) and `reset_prefix_cache`. Mixed into `LLMEngine`; every
call runs between steps, on the thread that steps the engine.

After a weight update, and after any sleep (the KV cache is dropped), the prefix cache is reset:
KV computed with other weights is never reused. While asleep, and after a level-2 sleep until the
weights are updated, `add_request` raises `EngineAsleepError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")
# runner methods whose state the engine keeps: called through the engine's own methods only
_ENGINE_OWNED = {"sleep": "sleep", "wake_up": "wake_up", "execute_model": None, "initialize_kv_cache": None}
_UPDATES = ("update_weights", "update_weights_from_path", "receive_weights")  # a prefix-cache reset follows


class EngineAsleepError(RuntimeError):
    """A request reached an engine that is asleep (the server answers 503)."""


class EngineRL:
    """Mixed into `LLMEngine` (which provides executor, scheduler, has_unfinished_requests)."""

    executor: Any
    scheduler: Any
    kv_events: Any = None  # the KV-events publisher (portside.engine.kv_events), if on
    _asleep: frozenset[str] = frozenset()  # the WAKE_TAGS still asleep
    _weights_undefined = False  # discarded by a level-2 sleep, woken, not yet updated
    sleep_level = 0

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`method` on every rank's model runner (`Executor.collective_rpc`); results by rank.
        The methods whose state the engine tracks (sleep, wake_up, steps) are refused here (use
        the engine's own); a weight update by name is followed by a prefix-cache reset."""
        if isinstance(method, str) and method in _ENGINE_OWNED:
            own = _ENGINE_OWNED[method]
            raise ValueError(f"collective_rpc: {method!r} changes state the engine keeps; "
                             + (f"call LLM.{own} (POST /{own})" if own else "the engine calls it itself"))
        results = self.executor.collective_rpc(method, tuple(args), kwargs)
        if method in _UPDATES:
            self._updated()
        return results

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (Hugging Face name, tensor) pairs into the model on every rank (each takes its
        shard; a pipeline stage the layers it holds); all or nothing: an unknown name, a wrong
        shape or dtype, or a quantized layer raises ValueError with the model unchanged. The
        prefix cache is reset. Returns the number of tensors."""
        self._check_weights_awake()
        n = self.executor.collective_rpc("update_weights", (list(weights),))[0]
        self._updated()
        return n

    def update_weights_from_path(self, path: str) -> int:
        """`update_weights` with every tensor of the safetensors checkpoint in folder `path`
        (dtypes converted as loading does); returns the number of tensors."""
        self._check_weights_awake()
        n = self.executor.collective_rpc("update_weights_from_path", (str(path),))[0]
        self._updated()
        return n

    def init_weight_transfer(self, host: str, port: int, world_size: int) -> None:
        """Join a trainer's weight-update group (`portside.distributed.weight_transfer`): the
        trainer is member 0 at host:port, this engine's ranks members 1..; blocks until all joined."""
        self.collective_rpc("init_weight_transfer", (host, int(port), 1, int(world_size)))

    def receive_weights(self) -> int:
        """Apply the trainer's next broadcast on every rank (blocks until it comes); all or
        nothing, as `update_weights`. The prefix cache is reset."""
        self._check_weights_awake()
        n = self.executor.collective_rpc("receive_weights")[0]
        self._updated()
        return n

    def close_weight_transfer(self) -> None:
        """Leave the weight-update group, with the trainer (which calls its `close`)."""
        self.executor.collective_rpc("close_weight_transfer")

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (requests running keep theirs, uncached); returns how many.
        Routers hear of it at once (`AllBlocksCleared`), even with no step to follow."""
        n = self.scheduler.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return n

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights offloaded to host memory, KV cache dropped; level 2: both dropped (the
        weights come back by `update_weights` / `update_weights_from_path`). Refused while
        requests are unfinished."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():  # type: ignore[attr-defined]
            raise ValueError("requests are still running: let them finish or abort them (POST /pause?mode=abort) "
                             "before sleeping")
        self.executor.collective_rpc("sleep", (level,))
        self.reset_prefix_cache()
        self._asleep, self.sleep_level = frozenset(WAKE_TAGS), level
        if level == 2:
            self._weights_undefined = True
        logger.info("engine asleep (level %d)", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (None: both), as vLLM's tags."""
        if tags is not None and (not isinstance(tags, (list, tuple)) or not set(tags) <= set(WAKE_TAGS) or not tags):
            raise ValueError(f"wake_up tags must be a non-empty list of {list(WAKE_TAGS)}, got {tags!r}")
        tags = list(tags or WAKE_TAGS)
        self.executor.collective_rpc("wake_up", (tags,))
        self._asleep = self._asleep - set(tags)
        if not self._asleep:
            self.sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def asleep_reason(self) -> str | None:
        """Why a request would be refused now (None: it would not)."""
        if self._asleep:
            return (f"the engine is asleep (level {self.sleep_level}, {', '.join(sorted(self._asleep))} released): "
                    "wake it up first (POST /wake_up, LLM.wake_up)")
        if self._weights_undefined:
            return ("the weights were discarded by a level-2 sleep: update them (update_weights / "
                    "update_weights_from_path) before generating")
        return None

    def _check_awake(self) -> None:
        reason = self.asleep_reason()
        if reason is not None:
            raise EngineAsleepError(reason)

    def _check_weights_awake(self) -> None:
        if "weights" in self._asleep:
            raise ValueError(f"the weights are asleep (sleep level {self.sleep_level}): wake_up(tags=['weights']) "
                             "before updating them")

    def _updated(self) -> None:
        self._weights_undefined = False
        self.reset_prefix_cache()
        self.scheduler.kv_loads.weights_changed()  # e.g. the disk tier stops: restarts load the checkpoint's KV
