"""Shape buckets for XLA: every step is padded to a (tokens, requests, block-table width) bucket,
so a workload whose shapes fall inside the buckets reuses graphs compiled at startup.

Pure Python (no torch_xla): tested in any leg.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Buckets", "BucketShape", "parse_buckets", "powers_of_two", "pick"]

MIN_TOKEN_BUCKET = 16


@dataclass(frozen=True, order=True)
class BucketShape:
    """One compiled shape: padded token count, request count and block-table width."""

    num_tokens: int
    num_reqs: int
    width: int


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from `low` (rounded up to one) up to `high`, plus `high` itself."""
    high = max(1, high)
    sizes = []
    size = 1
    while size < low:
        size *= 2
    while size < high:
        sizes.append(size)
        size *= 2
    sizes.append(high)
    return tuple(sorted(set(sizes)))


def parse_buckets(text: str, what: str = "buckets") -> tuple[int, ...]:
    """``"16,32,64"`` -> (16, 32, 64), sorted and de-duplicated; every value >= 1."""
    try:
        sizes = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{what} must be one or more integers >= 1, got {text!r}")
    return tuple(sizes)


def pick(n: int, sizes: tuple[int, ...]) -> int | None:
    """Smallest bucket >= n, or None when n is larger than every bucket."""
    for size in sizes:
        if size >= n:
            return size
    return None


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    requests: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def from_limits(cls, max_num_tokens: int, max_num_reqs: int, max_width: int) -> Buckets:
        """Defaults: powers of two up to each limit (requests never exceed tokens)."""
        max_num_reqs = min(max_num_reqs, max_num_tokens)
        return cls(
            tokens=powers_of_two(min(MIN_TOKEN_BUCKET, max_num_tokens), max_num_tokens),
            requests=powers_of_two(1, max_num_reqs),
            widths=powers_of_two(1, max_width),
        )

    def shapes(self) -> list[BucketShape]:
        """Every shape to precompile: tokens x requests x widths, skipping requests > tokens
        (each request has at least one token)."""
        return [
            BucketShape(t, r, w)
            for t in self.tokens
            for r in self.requests
            if r <= t
            for w in self.widths
        ]

    def select(self, num_tokens: int, num_reqs: int, width: int) -> tuple[BucketShape, bool]:
        """The bucket for a step, and whether it is one of the precompiled shapes. Outside the
        buckets each size is padded to the next power of two (a new compilation)."""
        t, r, w = pick(num_tokens, self.tokens), pick(num_reqs, self.requests), pick(max(1, width), self.widths)
        inside = t is not None and r is not None and w is not None and r <= t
        shape = BucketShape(
            t if t is not None else _next_power_of_two(num_tokens),
            r if r is not None else _next_power_of_two(num_reqs),
            w if w is not None else _next_power_of_two(max(1, width)),
        )
        if shape.num_reqs > shape.num_tokens:  # only outside the buckets
            shape = BucketShape(shape.num_reqs, shape.num_reqs, shape.width)
        return shape, inside
