"""The cpu backend's batched multi-LoRA (`CpuModelOps.lora_shrink` / `lora_expand`), grouped by
adapter, planned once per step (cached on the step's `LoRAMapping`) for every layer:

- in place, when the batch's tokens fall in few stretches of consecutive tokens on one slot (a
  prefill, a decode batch whose requests share adapters, every token on one adapter): per
  stretch, one matmul over x's rows as they are, and the expand one ``addmm_`` into the
  output's rows: nothing gathered, nothing scattered;
- otherwise, when the slots' token counts are about equal (a decode batch whose requests take the
  adapters in turn), as one batch (`Padded`): every slot's tokens gathered into rows of a
  ``[slots in use, most tokens of a slot, ...]`` tensor (short slots padded with a repeated
  row), one ``bmm`` with the slots' A (or B) for every slot at once, and one ``index_select``
  back to token order (the expand then one ``add_`` into the output's columns);
- otherwise by slot (`LoRAMapping.runs`): the tokens with an adapter gathered once in slot order,
  one matmul per slot in use over its contiguous rows (into one buffer), and one ``index_copy_``
  (shrink) or ``index_add_`` (expand) back to token order.

"Few" is at most the slots in use plus one per 16 tokens: a stretch costs two small matmul calls
(~10 us each), the gather and the scatter move every adapted token's x and output rows. "About
equal": padding adds at most a quarter of the adapted tokens, or at most `PAD_ROWS` rows. By slot,
the matmuls are small (a decode batch of 64 tokens on 4 adapters: 16 rows each) and cost their
call overhead more than their FLOPs, which is what one ``bmm`` saves: measured on the Zen 3 of
`ci/bench/results/lora_e2e.md`, one thread, the LoRA term of a q/k/v layer of hidden 576 at
rank 16 for 64 decode tokens on 4 adapters in turn took 0.69 ms by slot and 0.41 ms as one
batch (16 adapters: 1.52 and 0.50 ms; fastest of 200), next to 0.91 ms for the base layer's
matmul. Part of that: the expand never ``index_add_``s into the output's columns in this mode;
into a strided destination (a fused layer's slice) that ran 8-13x slower than into a contiguous
one (116 against 15 us for 64 x 576).

The matmuls run in fp32 whatever the model's dtype: an adapter's weights are small (R rows), and
torch's bf16 GEMMs on CPUs without native bf16 (AVX-512-BF16/AMX) are much slower than fp32 ones
(a bf16 ``addmm_`` into a strided output: 50x, on the Zen 3 of `ci/bench/results/lora.md`).
Traced by `torch.compile`, both are the opaque operators ``portside_cpu::lora_shrink`` /
``lora_expand``, by slot (their grouping reads slot counts on the host, which must not be traced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portside.contract import LoRAMapping

__all__ = ["lora_shrink", "lora_expand", "CpuLoRAOps", "Padded", "plan"]

Runs = tuple[tuple[int, int, int], ...]  # (slot, start, length): rows of x, or of the slot-sorted order
TOKENS_PER_STRETCH = 16  # in place while stretches <= slots in use + tokens / this
PAD_ROWS = 64  # as one padded batch while the padding adds at most this many rows (or a quarter)


@dataclass(frozen=True, eq=False)
class Padded:
    """The step's adapted tokens as one batch of ``len(slots)`` groups of `rows` rows: group j
    holds slot ``slots[j]``'s tokens (x's rows ``gather[j * rows : (j + 1) * rows]``, the tail
    repeating its first token), and token t's result is row ``scatter[t]`` of the flattened
    groups, or of the zero row after them (``len(slots) * rows``) for a token without adapter."""

    slots: tuple[int, ...]
    rows: int
    gather: torch.Tensor  # [len(slots) * rows] int64
    scatter: torch.Tensor  # [T] int64
    slot_index: torch.Tensor | None  # [len(slots)] int64; None: the slots are consecutive (a view)

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        """The groups' slots of a stacked weight ([S, ...] -> [len(slots), ...])."""
        if self.slot_index is None:
            return w.narrow(0, self.slots[0], len(self.slots))
        return w.index_select(0, self.slot_index)

    def bmm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each token's ``x[t] @ w[slot].T`` in token order ([T, w rows], fp32; 0 without adapter)."""
        groups, n = len(self.slots), w.shape[1]
        res = torch.empty(groups * self.rows + 1, n)
        res[-1].zero_()
        xs = x.index_select(0, self.gather).view(groups, self.rows, x.shape[1])
        torch.bmm(xs.float(), self.weights(w).float().transpose(1, 2), out=res[:-1].view(groups, self.rows, n))
        return res.index_select(0, self.scatter)


def _padded(mapping: LoRAMapping, runs: Runs) -> Padded | None:
    """The `Padded` batch of the tokens in `runs` (by slot), or None when padding would cost
    more than `PAD_ROWS` rows and a quarter of the adapted tokens."""
    if len(runs) < 2:
        return None
    active = sum(n for _, _, n in runs)
    rows = max(n for _, _, n in runs)
    if len(runs) * rows - active > max(PAD_ROWS, active // 4):
        return None
    order = mapping.segments().order
    gather = torch.empty(len(runs) * rows, dtype=torch.int64)
    scatter = torch.full((mapping.num_tokens,), len(runs) * rows, dtype=torch.int64)
    for j, (_, start, n) in enumerate(runs):
        tokens = order[start : start + n]
        gather[j * rows : j * rows + n] = tokens
        gather[j * rows + n : (j + 1) * rows] = tokens[0]
        scatter[tokens] = torch.arange(j * rows, j * rows + n)
    slots = tuple(s for s, _, _ in runs)
    consecutive = slots == tuple(range(slots[0], slots[0] + len(slots)))
    return Padded(slots, rows, gather, scatter, None if consecutive else torch.tensor(slots))


def _mm_into(dst: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """dst = x @ w.T, computed in fp32."""
    if dst.dtype == torch.float32:
        torch.mm(x.float(), w.float().t(), out=dst)
    else:
        dst.copy_(torch.mm(x.float(), w.float().t()))


def _shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, in_place: bool, runs: Runs,
            padded: Padded | None = None) -> torch.Tensor:  # fmt: skip
    if padded is not None:
        return padded.bmm(x, a).to(x.dtype)
    y = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype)
    if in_place:
        for slot, start, n in runs:
            _mm_into(y[start : start + n], x[start : start + n], a[slot])
        return y
    if not runs:
        return y
    active = order[: runs[-1][1] + runs[-1][2]]  # the tokens with an adapter, by slot
    xs = x.index_select(0, active)
    ys = torch.empty(active.shape[0], a.shape[1])
    for slot, start, n in runs:
        _mm_into(ys[start : start + n], xs[start : start + n], a[slot])
    return y.index_copy_(0, active, ys.to(x.dtype))


def _expand(y: torch.Tensor, b: torch.Tensor, order: torch.Tensor, in_place: bool, runs: Runs, padded: Padded | None,
            out: torch.Tensor, off: int) -> None:  # fmt: skip
    cols = out[:, off : off + b.shape[1]]
    if padded is not None:
        cols.add_(padded.bmm(y, b))  # fp32 deltas: summed in fp32, rounded once
        return
    if in_place:
        for slot, start, n in runs:
            rows = cols[start : start + n]
            if out.dtype == torch.float32:
                rows.addmm_(y[start : start + n], b[slot].t())
            else:  # summed in fp32, rounded once
                rows.add_(torch.mm(y[start : start + n].float(), b[slot].float().t()))
        return
    if not runs:
        return
    active = order[: runs[-1][1] + runs[-1][2]]
    ys = y.index_select(0, active)
    deltas = torch.empty(active.shape[0], b.shape[1])
    for slot, start, n in runs:
        _mm_into(deltas[start : start + n], ys[start : start + n], b[slot])
    cols.index_add_(0, active, deltas.to(out.dtype))


def _stretches(token_slots: torch.Tensor) -> Runs:
    """(slot, first token, tokens) of each stretch of consecutive tokens on one slot (-1 left out)."""
    slots, lengths = torch.unique_consecutive(token_slots, return_counts=True)
    runs, start = [], 0
    for slot, n in zip(slots.tolist(), lengths.tolist(), strict=True):
        if slot >= 0:
            runs.append((slot, start, n))
        start += n
    return tuple(runs)


def plan(mapping: LoRAMapping) -> tuple[bool, Runs, Padded | None]:
    """(in place, runs, padded) for every layer of the step: stretches of x's rows (in place);
    else one padded batch of the slots' tokens, when they are about as many on every slot
    (`padded`); else slot runs (`runs`)."""

    def build() -> tuple[bool, Runs, Padded | None]:
        stretches, by_slot = _stretches(mapping.token_slots), mapping.runs()
        if len(stretches) <= len(by_slot) + mapping.num_tokens // TOKENS_PER_STRETCH:
            return True, stretches, None
        return False, by_slot, _padded(mapping, by_slot)

    return mapping.cached("cpu.lora_plan", build)


def _runs(counts: torch.Tensor) -> Runs:
    """`LoRAMapping.runs` from the slot counts (the operators' form of the grouping)."""
    runs, start = [], 0
    for slot, n in enumerate(counts.tolist()):
        if n:
            runs.append((slot, start, n))
            start += n
    return tuple(runs)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return _shrink(x, a, order, False, _runs(counts))


def lora_expand(y: torch.Tensor, b: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
                out_offset: int) -> None:  # fmt: skip
    _expand(y, b, order, False, _runs(counts), None, out, out_offset)


_lib = torch.library.Library("portside_cpu", "FRAGMENT")
_lib.define("lora_shrink(Tensor x, Tensor a, Tensor order, Tensor counts) -> Tensor")
_lib.define("lora_expand(Tensor y, Tensor b, Tensor order, Tensor counts, Tensor(a!) out, int out_offset) -> ()")
_lib.impl("lora_shrink", lora_shrink, "CPU")
_lib.impl("lora_expand", lora_expand, "CPU")


@torch.library.register_fake("portside_cpu::lora_shrink")
def _lora_shrink_fake(x, a, order, counts):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], a.shape[1]))


@torch.library.register_fake("portside_cpu::lora_expand")
def _lora_expand_fake(y, b, order, counts, out, out_offset):  # noqa: ANN001, ANN202
    return None


class CpuLoRAOps:
    """`ModelOps` mixin: the grouped LoRA kernels above; eager calls follow the step's `plan`
    directly (no operator dispatch), traced ones the opaque operators; operands of mixed dtypes
    go to the reference (``super()``)."""

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        if x.dtype != a.dtype or x.device.type != "cpu":
            return super().lora_shrink(x, a, mapping)  # type: ignore[misc]
        seg = mapping.segments()
        if torch.compiler.is_compiling():
            return torch.ops.portside_cpu.lora_shrink(x, a, seg.order, seg.counts)
        return _shrink(x, a, seg.order, *plan(mapping))

    def lora_expand(self, y: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor,
                    out_offset: int = 0) -> None:  # fmt: skip
        if not y.dtype == b.dtype == out.dtype or out.device.type != "cpu":
            super().lora_expand(y, b, mapping, out, out_offset)  # type: ignore[misc]
            return
        seg = mapping.segments()
        if torch.compiler.is_compiling():
            torch.ops.portside_cpu.lora_expand(y, b, seg.order, seg.counts, out, out_offset)
        else:
            _expand(y, b, seg.order, *plan(mapping), out, out_offset)
