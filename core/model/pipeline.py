"""Pipeline parallelism's split of a decoder: which consecutive layers each stage holds. Pure
Python (no torch), so engine arguments can check a split before any model code loads."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineStage", "pipeline_stages"]


@dataclass(frozen=True)
class PipelineStage:
    """The decoder layers [start, end) one pipeline-parallel stage holds, of `num_stages`. The
    first stage embeds the tokens, the last holds the final norm and the LM head; every other
    stage's input is the hidden state the previous one computed (`ForwardContext.inputs_embeds`)
    and a non-last stage returns its residual stream un-normalised, for the next."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def pipeline_stages(num_layers: int, num_stages: int, layers: tuple[int, ...] | None = None) -> list[PipelineStage]:
    """Split `num_layers` decoder layers into `num_stages` consecutive stages: `layers` per stage
    if given, else balanced by count (the first `num_layers % num_stages` stages one more)."""
    if layers is None:
        if num_stages > num_layers:
            raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} decoder layers")
        base, extra = divmod(num_layers, num_stages)
        layers = tuple(base + (s < extra) for s in range(num_stages))
    if len(layers) != num_stages or sum(layers) != num_layers or min(layers) < 1:
        raise ValueError(f"pipeline_layers {list(layers)} must be {num_stages} positive counts summing to the model's "
                         f"{num_layers} decoder layers")
    starts = [sum(layers[:s]) for s in range(num_stages)]
    return [PipelineStage(s, num_stages, starts[s], starts[s] + layers[s]) for s in range(num_stages)]
