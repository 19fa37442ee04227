"""Per-step batched sampling state: `SamplingMetadata`, built once per step from the requests.

The model runner calls `SamplingMetadata.build(...)` with one entry per row of the logits it will
hand to the `Sampler`. Everything the sampler needs is turned into tensors here, and features no
row uses are left as `None`, so a plain greedy batch costs one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from portside.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _generator(device: torch.device | str) -> torch.Generator:
    """A generator on `device`, or on the host for devices without their own (XLA): the
    sampler then draws that row's noise on the host and copies it over."""
    try:
        return torch.Generator(device=device)
    except RuntimeError:
        return torch.Generator(device="cpu")


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed of a seeded request's draw for output token number `num_output_tokens`.

    Depends only on the request's own seed and position (splitmix64 mixing), never on the batch,
    so a seeded request gives the same tokens alone, in any batch, at any batch position, and
    after a preemption that recomputes it.
    """
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x >> 1  # 63 bits: valid for every torch.Generator.manual_seed


@dataclass
class SamplingMetadata:
    """Batched sampling parameters for N rows of logits [N, V].

    Optional tensors are `None` when no row of the batch uses the feature.
    """

    # [N] fp32 temperatures; 1.0 on greedy rows (their value is never used to divide)
    temperature: torch.Tensor
    # [N] bool: row is greedy (temperature < 1e-5 or top_k == 1): argmax of the processed logits
    greedy_mask: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [N] int64: tokens kept by top-k (V on rows without top-k)
    top_k: torch.Tensor | None
    # [N] fp32: nucleus mass (1.0 on rows without top-p)
    top_p: torch.Tensor | None
    # [N] fp32: min-p ratio to the most likely token's probability (0.0 on rows without min-p)
    min_p: torch.Tensor | None
    no_penalties: bool
    # [N] fp32 each; all three are set together when `no_penalties` is False
    repetition_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    # [N, V] bool: token occurs in the prompt (only built when a row has a repetition penalty)
    prompt_mask: torch.Tensor | None
    # [N, V] fp32: occurrences of each token among the output tokens (set when penalties are on)
    output_counts: torch.Tensor | None
    # logit_bias as a sparse list: logits[rows[i], cols[i]] += values[i]; [M] each
    bias_rows: torch.Tensor | None
    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None
    # (rows, cols) [M] each: eos / stop ids banned because a row has fewer than min_tokens outputs
    min_tokens_rows: torch.Tensor | None
    min_tokens_cols: torch.Tensor | None
    # row -> generator of a seeded random row, seeded with row_seed(seed, num_output_tokens)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # per row: the `logprobs` it asked for (None: none); max over rows (None: no row asked)
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def reusable(self) -> bool:
        """True when the same rows' metadata stays valid as they sample more tokens: nothing here
        depends on their outputs (no penalties, no seeded generator, no min_tokens ban left: a ban
        only ever lifts, and is built only while some row's outputs are short of min_tokens)."""
        return self.no_penalties and not self.generators and self.min_tokens_rows is None

    @property
    def needs_logits_processing(self) -> bool:
        """True when logit_bias, min_tokens or penalties change some row's logits."""
        return not self.no_penalties or self.bias_rows is not None or self.min_tokens_rows is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Batch the parameters of N rows (row i: `params[i]`, its prompt and its output so far).

        `vocab_size` must equal the width of the logits the sampler gets. Raises ValueError when a
        logit_bias token id is outside the vocabulary; stop token ids outside it are ignored.
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == n):
            raise ValueError("params, prompt_token_ids and output_token_ids must have one entry per row")
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        random_rows = [i for i in range(n) if not greedy[i]]
        top_k = top_p = min_p = None
        if any(params[i].top_k != -1 for i in random_rows):
            top_k = torch.tensor(
                [min(p.top_k, vocab_size) if p.top_k != -1 else vocab_size for p in params],
                dtype=torch.int64,
                device=device,
            )
        if any(params[i].top_p < 1.0 for i in random_rows):
            top_p = floats([p.top_p for p in params])
        if any(params[i].min_p > 0.0 for i in random_rows):
            min_p = floats([p.min_p for p in params])

        no_penalties = all(
            p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            for p in params
        )
        rep = pres = freq = prompt_mask = output_counts = None
        if not no_penalties:
            rep = floats([p.repetition_penalty for p in params])
            pres = floats([p.presence_penalty for p in params])
            freq = floats([p.frequency_penalty for p in params])
            output_counts = _token_counts(output_token_ids, vocab_size, device)
            if any(p.repetition_penalty != 1.0 for p in params):
                prompt_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        for _, t, _ in bias:
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"logit_bias token id {t} is outside the vocabulary (size {vocab_size})")
        bias_rows = bias_cols = bias_values = None
        if bias:
            bias_rows = torch.tensor([r for r, _, _ in bias], dtype=torch.int64, device=device)
            bias_cols = torch.tensor([int(t) for _, t, _ in bias], dtype=torch.int64, device=device)
            bias_values = floats([float(b) for _, _, b in bias])

        banned: list[tuple[int, int]] = []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) >= p.min_tokens:
                continue
            stop_ids = set(p.stop_token_ids or [])
            if eos_token_id is not None and not p.ignore_eos:
                stop_ids.add(eos_token_id)
            banned += [(i, t) for t in sorted(stop_ids) if 0 <= t < vocab_size]
        min_tokens_rows = min_tokens_cols = None
        if banned:
            min_tokens_rows = torch.tensor([r for r, _ in banned], dtype=torch.int64, device=device)
            min_tokens_cols = torch.tensor([t for _, t in banned], dtype=torch.int64, device=device)

        generators: dict[int, torch.Generator] = {}
        for i in random_rows:
            seed = params[i].seed
            if seed is not None:
                g = _generator(device)
                g.manual_seed(row_seed(seed, len(output_token_ids[i])))
                generators[i] = g

        num_logprobs = [p.logprobs for p in params]
        wanted = [k for k in num_logprobs if k is not None]
        return cls(
            temperature=floats(temperature),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            no_penalties=no_penalties,
            repetition_penalties=rep,
            presence_penalties=pres,
            frequency_penalties=freq,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            bias_rows=bias_rows,
            bias_cols=bias_cols,
            bias_values=bias_values,
            min_tokens_rows=min_tokens_rows,
            min_tokens_cols=min_tokens_cols,
            generators=generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
        )


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] fp32 count of each token id per row (ids outside [0, V) are ignored)."""
    n = len(token_ids)
    width = max((len(t) for t in token_ids), default=0)
    # pad with vocab_size: counted in an extra column that is dropped
    padded = torch.full((n, width), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(token_ids):
        if ids:
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = padded.masked_fill((padded < 0) | (padded > vocab_size), vocab_size).to(device)
    counts = torch.zeros((n, vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
