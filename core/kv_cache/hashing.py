"""Chained block hashes for the prefix cache.

A full block's hash covers its tokens and, through its parent's hash, every token before it, so
equal hashes mean equal prefixes unless the hash collides. Collisions are harmless: a hit is
confirmed against the stored tokens (see `BlockPool.lookup`). Python's `hash` of an int tuple is
deterministic across processes, and a first block chains on -1 (a value `hash` never returns)
rather than on None (whose hash is its address before Python 3.12), so a text-only chain hashes
the same in every process: a restarted server finds its disk-tier blocks (`portside.kv_transfer`).
What a block depends on beside its tokens (a LoRA adapter, image identifiers) enters the chain as
`stable_key` digests, never as `str` hashes (those differ between processes unless PYTHONHASHSEED
is fixed), so adapter and image blocks are found again after a restart too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence


def stable_key(*parts: object) -> int:
    """A 64-bit integer digest of `parts` (as text), equal in every process (unlike `hash` of a `str`)."""
    digest = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], extra: tuple[str, ...] = ()) -> int:
    """Hash of one full block, chained on the previous block's hash (None for the first);
    `extra`: what its KV depends on beside the tokens (the images whose placeholders it holds)."""
    parent = -1 if parent_hash is None else parent_hash
    return hash((parent, token_ids, tuple(stable_key(e) for e in extra))) if extra else hash((parent, token_ids))


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, hashes: list[int], num_blocks: int | None = None, root: int | None = None,
    extra_keys: Callable[[int, int], tuple[str, ...]] | None = None,
) -> list[int]:
    """Extend `hashes` (the chain so far) to cover the full blocks of `token_ids`, or the first
    `num_blocks` of them, and return it. Existing entries are reused, never recomputed. `root`:
    what the first block chains on (e.g. a LoRA adapter's id: other KV for the same tokens);
    `extra_keys(start, end)`: what positions [start, end) depend on beside their tokens."""
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else root
        start, end = i * block_size, (i + 1) * block_size
        extra = extra_keys(start, end) if extra_keys is not None else ()
        block = tuple(token_ids[start:end])
        hashes.append(hash_block_tokens(parent, block, extra) if extra else hash_block_tokens(parent, block))
    return hashes
