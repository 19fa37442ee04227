"""Which data-parallel replica serves a request: prefix-cache affinity, balanced by load.

Each replica has its own prefix cache, so a prompt whose beginning another request already
computed is cheapest on the replica that computed it. The router remembers, for the first
AFFINITY_BLOCKS full KV blocks of every prompt it routed, the chained hash of each prefix
(blocks 1, 1-2, 1-2-3, ...; chained on the LoRA adapter id, as the engines' block hashes are)
and the replica it went to, in a bounded LRU table. The rule for a new request:

1. preferred replica: the one that took the longest remembered prefix of this prompt (none when
   no full block matches, e.g. a prompt shorter than one block);
2. least loaded replica: the fewest unfinished sequences (a request's n samples each); ties go
   round-robin, so an idle server alternates;
3. go to the preferred replica unless it is busier than the least loaded one by more than
   AFFINITY_SLACK sequences plus a quarter of the least loaded one's load; then (and without a
   preference) go to the least loaded one.

Prompts of the same long prefix (a shared system prompt plus documents, a conversation's earlier
turns) therefore land together until that replica runs clearly ahead, and everything else
spreads by load. Only the prefix table is state: no replica is ever asked anything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_BLOCKS = 4  # prefixes remembered per prompt: its first 1..4 full KV blocks
AFFINITY_SLACK = 8  # sequences a preferred replica may be ahead of the least loaded one (plus 25%)
TABLE_SIZE = 1 << 16  # prefix hashes remembered (least recently routed forgotten first)


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, table_size: int = TABLE_SIZE) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError("PrefixRouter needs at least one replica and a positive block size")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.table_size = table_size
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica that last took it
        self._turn = 0  # where the round-robin among equally loaded replicas starts

    def prefix_hashes(self, prompt_ids: Sequence[int], salt: int = 0) -> list[int]:
        """Chained hashes of the prompt's first full blocks (at most AFFINITY_BLOCKS)."""
        hashes, h, size = [], hash(("portside-dp", salt)), self.block_size
        for k in range(min(len(prompt_ids) // size, AFFINITY_BLOCKS)):
            h = hash((h, tuple(prompt_ids[k * size:(k + 1) * size])))
            hashes.append(h)
        return hashes

    def preferred(self, hashes: list[int]) -> int | None:
        """The replica that took the longest remembered prefix, if any."""
        for h in reversed(hashes):
            replica = self._owner.get(h)
            if replica is not None:
                return replica
        return None

    def choose(self, prompt_ids: Sequence[int] | None, loads: Sequence[int], salt: int = 0) -> int:
        """The replica for a prompt (None: unknown ids, no affinity) given each replica's load
        (unfinished sequences); remembers the choice for the prompt's prefixes."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"expected {self.num_replicas} loads, got {len(loads)}")
        order = [(self._turn + i) % self.num_replicas for i in range(self.num_replicas)]
        least = min(order, key=lambda i: loads[i])
        hashes = self.prefix_hashes(prompt_ids, salt) if prompt_ids is not None else []
        preferred = self.preferred(hashes)
        if preferred is not None and loads[preferred] <= loads[least] + AFFINITY_SLACK + loads[least] // 4:
            chosen = preferred
        else:
            chosen = least
            self._turn = (least + 1) % self.num_replicas
        for h in hashes:
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.table_size:
            self._owner.popitem(last=False)
        return chosen
