"""The engine's side of structured output: compiled grammars (cached by constraint), one
`StructuredState` per constrained sequence, and each step's token bitmask.

The bitmask of a step is filled on a worker thread while the model runs its forward pass (the
grammar engines release the GIL), and the sampler waits for it only when it needs it. Pickling a
`GrammarBitmask` (to send it to other tensor-parallel ranks) waits for it first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from portside.structured.backend import CompiledGrammar, Matcher, allocate_bitmask, make_backend
from portside.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_SPEC_BYTES = 128 * 1024  # a schema / grammar / regex larger than this is refused
# Grammar engines compile recursively: a chain of ~1000 nested `$ref`s (70 KiB of schema)
# overflows an 8 MiB thread stack (a segfault, measured with llguidance 1.9). Compiles run on
# threads with this much stack (address space; only what is touched is committed).
COMPILE_STACK_BYTES = 512 << 20
COMPILE_THREADS = 2
_STACK_LOCK = threading.Lock()


@dataclass
class StructuredState:
    """One sequence's grammar state, and where it stands with respect to reasoning.

    With a reasoning parser, the grammar applies to the answer after the reasoning: a sequence
    whose prompt opens a think block is unconstrained until the end marker; one whose prompt does
    not may start with the start marker (its bit is added to the first mask) and is then free
    until the end marker too."""

    matcher: Matcher
    start_token_id: int | None = None  # set with a reasoning parser
    end_token_id: int | None = None
    in_reasoning: bool = False
    may_open: bool = False  # the next token may open a think block (nothing sampled yet)

    @property
    def wants_mask(self) -> bool:
        return not self.in_reasoning

    def allow_reasoning_start(self, bitmask: torch.Tensor, row: int) -> None:
        """On the first token of an output that may think, the start marker is allowed too."""
        if self.may_open and self.start_token_id is not None:
            _set_bit(bitmask, row, self.start_token_id)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; True when the sequence must end here (output complete,
        or a token the grammar refused)."""
        if self.in_reasoning:
            if token_id == self.end_token_id:
                self.in_reasoning = False
            return False
        if self.may_open:
            self.may_open = False
            if token_id == self.start_token_id:
                self.in_reasoning = True
                return False
        if not self.matcher.accept_token(token_id):
            logger.warning("structured output: the grammar refused token %d (%s)", token_id, self.matcher.error() or "not allowed")
            return True
        return self.matcher.is_terminated()

    @property
    def can_speculate(self) -> bool:
        """Proposals are verified under the grammar only outside reasoning, with a matcher that
        rolls back (a backend without `rollback` is never speculated)."""
        return not self.in_reasoning and not self.may_open and callable(getattr(self.matcher, "rollback", None))

    def valid_drafts(self, tokens: list[int], stats: Any = None) -> list[int]:
        """The longest prefix of `tokens` (proposals) the grammar allows from here, cut at the
        first refused one or where the output completes; the matcher is left as it was. The
        tokens cut are counted in `stats.num_draft_tokens_cut_by_grammar` (a SpecDecodeStats)."""
        n = 0
        if tokens and self.can_speculate:
            while n < len(tokens) and not self.matcher.is_terminated() and self.matcher.accept_token(tokens[n]):
                n += 1
            self.matcher.rollback(n)
        if stats is not None:
            stats.num_draft_tokens_cut_by_grammar += len(tokens) - n
        return tokens[:n]

    def fill_draft_rows(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row + 1 .. row + len(drafts): the mask after each proposal in turn (row `row`, the
        one before them, is filled with the others'). Rows after a proposal the grammar refuses
        stay all-allowed: verification stops at that proposal, which its own mask refuses."""
        n = 0
        while n < len(drafts) and self.matcher.accept_token(drafts[n]):
            n += 1
            self.matcher.fill_bitmask(bitmask, row + n)
        self.matcher.rollback(n)


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    b = token_id % 32
    bitmask[row, token_id // 32] |= (1 << b) if b < 31 else -(1 << 31)  # int32: bit 31 is the sign


@dataclass
class GrammarBitmask:
    """The packed masks of one step ([rows, ceil(V / 32)] int32): `num_rows[i]` consecutive rows
    belong to `req_ids[i]`, one per position it samples (1 + its proposals under speculation)."""

    req_ids: list[str]
    num_rows: list[int]
    _future: Future[torch.Tensor] | None = None
    _bitmask: torch.Tensor | None = field(default=None)

    def get(self) -> torch.Tensor:
        if self._bitmask is None:
            assert self._future is not None
            self._bitmask = self._future.result()
            self._future = None
        return self._bitmask

    def __getstate__(self) -> dict[str, Any]:
        return {"req_ids": self.req_ids, "num_rows": self.num_rows, "_future": None, "_bitmask": self.get()}


class StructuredOutputManager:
    """Compiles constraints with one grammar engine and builds each step's bitmask."""

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 reasoning_parser: Any | None = None, cache_size: int = 256) -> None:
        self.backend_name = backend
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._backend: Any = None  # built on first use: ~1 s for a large vocabulary
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.reasoning = reasoning_parser
        self._cache: OrderedDict[tuple[Any, ...], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # mask filling
        self._compile_pool: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> Any:
        with self._lock:
            if self._backend is None:
                self._backend = make_backend(self.backend_name, *self._args)
                self.vocab_size = self._backend.vocab_size
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a constraint (cached); ValueError naming the problem when it is
        invalid, too large, or can never be satisfied. Thread-safe: the server compiles off the
        event loop before it submits, and the engine then finds the result here."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if len(params.spec.encode()) > MAX_SPEC_BYTES:
            raise ValueError(f"structured_outputs: the {params.kind} is larger than {MAX_SPEC_BYTES // 1024} KiB; simplify it")
        return self._compile_threads().submit(self._compile, key, params).result()

    def _compile_threads(self) -> ThreadPoolExecutor:
        """The compile threads, created at once with a deep stack (`COMPILE_STACK_BYTES`)."""
        with self._lock:
            if self._compile_pool is None:
                with _STACK_LOCK:
                    old = threading.stack_size(COMPILE_STACK_BYTES)
                    try:
                        pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="portside-grammar-compile")
                        barrier = threading.Barrier(COMPILE_THREADS)  # every task waits: one thread each
                        for f in [pool.submit(barrier.wait) for _ in range(COMPILE_THREADS)]:
                            f.result()
                    finally:
                        threading.stack_size(old)
                self._compile_pool = pool
            return self._compile_pool

    def _compile(self, key: tuple[Any, ...], params: StructuredOutputsParams) -> CompiledGrammar:
        backend = self.backend
        grammar = backend.compile(params)
        probe = grammar.matcher()
        mask = allocate_bitmask(1, backend.vocab_size)
        probe.fill_bitmask(mask, 0)  # a matcher fails on its first step when nothing can match
        if probe.error() is not None or not bool((mask != 0).any()):
            raise ValueError(f"structured_outputs: the {params.kind} can never be satisfied: no output matches it"
                             + (f" ({probe.error()})" if probe.error() else ""))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def new_state(self, grammar: CompiledGrammar, prompt_token_ids: list[int], after_reasoning: bool = True) -> StructuredState:
        state = StructuredState(grammar.matcher())
        if self.reasoning is not None and after_reasoning:
            state.start_token_id = self.reasoning.start_token_id
            state.end_token_id = self.reasoning.end_token_id
            state.in_reasoning = bool(self.reasoning.prompt_opens_reasoning(prompt_token_ids))
            # a prompt that already holds a think block (Qwen3 with enable_thinking=False renders
            # an empty one) answers at once; one without any may still open one
            state.may_open = not state.in_reasoning and self.reasoning.start_token_id not in prompt_token_ids
        return state

    def grammar_bitmask(self, rows: list[tuple[str, StructuredState, list[int]]]) -> GrammarBitmask | None:
        """Start filling the masks of the sequences that sample this step under a grammar: each
        row is (request id, state, the proposals it verifies this step)."""
        rows = [r for r in rows if r[1].wants_mask]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portside-grammar")
        items = [(s, d) for _, s, d in rows]
        return GrammarBitmask([r[0] for r in rows], [1 + len(d) for _, _, d in rows], self._pool.submit(self._fill, items))

    def _fill(self, items: list[tuple[StructuredState, list[int]]]) -> torch.Tensor:
        starts = [0]
        for _, drafts in items:
            starts.append(starts[-1] + 1 + len(drafts))
        bitmask = allocate_bitmask(starts[-1], self.vocab_size)
        states = [s for s, _ in items]
        fill_batch = getattr(self.backend, "fill_batch", None)
        if fill_batch is not None and len(states) > 1:
            fill_batch([(s.matcher, r) for s, r in zip(states, starts)], bitmask)
        else:
            for s, r in zip(states, starts):
                s.matcher.fill_bitmask(bitmask, r)
        for (s, drafts), r in zip(items, starts):
            s.allow_reasoning_start(bitmask, r)
            if drafts:
                s.fill_draft_rows(bitmask, r, drafts)
        owner = [i for i, (_, drafts) in enumerate(items) for _ in range(1 + len(drafts))]
        for row in (~(bitmask != 0).any(dim=1)).nonzero().flatten().tolist():
            # a matcher that failed (a resource limit) allows nothing: let that sequence end
            logger.warning("structured output: no token is allowed (%s); ending the sequence",
                           states[owner[row]].matcher.error() or "grammar exhausted")
            for eos in self.eos_token_ids[:1]:
                _set_bit(bitmask, row, eos)
        return bitmask

    def shutdown(self) -> None:
        """Stop the worker threads; a later use starts new ones (data-parallel replicas share one
        manager, and the first replica to stop must not break the others)."""
        pools, self._pool, self._compile_pool = (self._pool, self._compile_pool), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
