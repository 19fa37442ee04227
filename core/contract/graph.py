"""Graph capture: the `GraphRunner` that runs the model for one step (replaying a captured or
compiled graph where it can), the model it is handed (`ModelFn`; `PiecewiseModel` for runners
that compile only the dense parts), and `EagerGraphRunner`, the fallback every platform can use.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from portside.contract.attention import ForwardContext

if TYPE_CHECKING:  # config imports nothing from the contract; this only names the type
    from portside.config import EngineConfig

__all__ = ["EagerGraphRunner", "GraphRunner", "ModelFn", "PiecewiseModel"]

ModelFn = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]
"""model_fn(input_ids [T], positions [T], ctx) -> hidden states [T, hidden] (before the LM head).
The runner passes the model itself, which also has ``compute_logits(hidden) -> logits`` (the LM
head, `GraphRunner.compute_logits`) and is a `PiecewiseModel` where its architecture allows. A
step's input embeddings, where the model does not embed the ids itself (a later pipeline stage,
image rows), travel in the context: `ForwardContext.inputs_embeds`."""


@runtime_checkable
class PiecewiseModel(Protocol):
    """A model cut at its attention calls. The runner hands graph runners the model itself as
    `model_fn`; one that compiles only the dense parts (OpenVINO segments, piecewise graphs)
    checks ``isinstance(model_fn, PiecewiseModel)`` and runs paged attention between the pieces:

        h, aux = embed(input_ids, positions, ctx.inputs_embeds)  # aux: what every layer uses (rotary)
        for i in range(num_layers):
            q, k, v = pre_attention(i, h, aux)        # q [T, H, D]; k, v [T, KVH, D]
            o = ctx.attention(i, q, k, v, attention_scale(i), **attention_features(i))
            h = post_attention(i, h, o)               # o [T, H, D] -> h [T, hidden]
        hidden = final_norm(h)

    equals ``model_fn(input_ids, positions, ctx)``. `attention_features(i)` is layer i's
    `ATTENTION_FEATURES` as keyword arguments (empty for a Llama); a runner written before it
    existed may read it with ``getattr(model, "attention_features", None)``.
    """

    @property
    def num_layers(self) -> int:
        """Decoder layers of this model (of its pipeline stage)."""
        ...

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(h [T, hidden], aux): the embeddings and the per-token tensors every layer uses. h is
        `inputs_embeds` where given (`ForwardContext.inputs_embeds`: a later pipeline stage's
        input, or token embeddings with images merged in); a runner that never runs such steps
        (`GraphRunner.supports_pipeline_stages` False) may call ``embed(input_ids, positions)``."""
        ...

    def pre_attention(self, i: int, h: torch.Tensor, aux: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Layer i up to its attention: (q [T, H, D], k [T, KVH, D], v [T, KVH, D])."""
        ...

    def post_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Layer i after its attention: the residual stream h and the attention output o -> h."""
        ...

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The last norm: h -> hidden states [T, hidden] (before the LM head)."""
        ...

    def attention_scale(self, i: int) -> float:
        """Layer i's softmax scale."""
        ...

    def attention_features(self, i: int) -> dict[str, Any]:
        """Layer i's `ATTENTION_FEATURES`, as keyword arguments of `ForwardContext.attention`."""
        ...


class GraphRunner(ABC):
    """Runs the model for one step; may capture and replay graphs for shapes it prepared.

    `capture` is called once after the KV cache exists (it may run the model on dummy inputs);
    `__call__` then runs every step with exactly the arguments `model_fn` takes.
    """

    name: ClassVar[str] = "abstract"
    """The implementation's name, in logs."""
    supports_pipeline_stages: ClassVar[bool] = False
    """Pipeline parallelism: whether it can run one stage of a model, whose input is the previous
    stage's hidden states (the step's `ForwardContext.inputs_embeds`, which the model's `embed`
    returns as h; zeros in a call without one, such as a warm-up on dummy inputs), and which has
    no LM head unless it is the last stage. Such a runner hands the model each step's context as
    it got it (or calls ``embed(input_ids, positions, ctx.inputs_embeds)`` itself). A runner that
    captures or compiles the embedding leaves this False; the engine then runs such stages with
    `EagerGraphRunner`. The same goes for a vision-language model's steps with image rows:
    `inputs_embeds` then holds the step's token embeddings with the images' merged in."""
    supports_recurrent_state: ClassVar[bool] = False
    """Hybrid models (layers with a recurrent state, `portside.contract.recurrent`): whether it runs
    them op by op, handing the model each step's context as it got it (its `state_caches` and
    `recurrent` metadata: the kernels update the states in place, and which slot each request
    uses changes every step). A runner that captures or fuses steps leaves this False; the engine
    then runs such models with `EagerGraphRunner`. `capture`'s dummy contexts carry the states too
    (every request in the scratch slot)."""

    def __init__(self, model_fn: ModelFn, config: EngineConfig) -> None:
        self.model_fn = model_fn
        """The model (`ModelFn`)."""
        self.config = config
        """The engine's (frozen) configuration, after `Platform.check_and_update_config`."""

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        """Prepare graphs. `make_dummy_context(num_decodes)` builds a decode-only context
        (with valid scratch KV slots) for a padded batch of that size. Default: nothing."""

    @abstractmethod
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One step: what ``model_fn(input_ids, positions, ctx)`` returns."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: hidden [N, hidden] of the sampled rows -> logits [N, vocab]. Default: the
        model's own (`model_fn.compute_logits`); a runner may compile it with the model."""
        return self.model_fn.compute_logits(hidden)  # type: ignore[attr-defined]

    def logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of rows `indices` ([N] int64) of this step's `hidden` (what the last
        `__call__` returned), called at most once per step. Default: `compute_logits` of those
        rows; a runner that already computed them in the step's graph returns those."""
        return self.compute_logits(hidden[indices])

    def eager_mode(self, rows: int) -> contextlib.AbstractContextManager[Any]:
        """The context in which a module that runs op by op beside the model (a speculative
        head's forward of `rows` rows, an EAGLE-3 target step) gets the faster kernels this
        runner's own op-by-op steps use (the cpu backend's: its one-row and prepacked linears).
        Default: none (torch's kernels)."""
        return contextlib.nullcontext()


class EagerGraphRunner(GraphRunner):
    """No capture: every step runs the model eagerly. The fallback every platform can use."""

    name = "eager"
    supports_pipeline_stages = True
    supports_recurrent_state = True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``model_fn(input_ids, positions, ctx)``."""
        return self.model_fn(input_ids, positions, ctx)
