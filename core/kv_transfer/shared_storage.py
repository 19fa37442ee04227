"""The shared-storage KV connector, scheduler half: KV blocks handed between instances through a
directory both can read (disaggregated prefill and decode; vLLM's SharedStorageConnector).

A producer (`--kv-role producer`, or `both`) writes each request's full prompt blocks to the
directory as soon as the step that computed them has run: the worker half writes them after that
step's forward, before its outputs go back, so by the time the prefill instance answers (the proxy
asks it for one token, `portside disagg-proxy`) the files are there. A consumer (`consumer`, or
`both`) looks for a waiting request's prompt blocks past its device prefix hit, in chain order,
and loads the run it finds before the request is scheduled (`portside.sched.kv_loads`); it
computes the rest. Nothing is passed between the instances but the prompt: blocks are named by the
prefix cache's content hash (`portside.kv_cache.hashing`; a text-only chain hashes the same in
every process), in ``<dir>/portside-kv-<fingerprint>/`` (the model, dtype and neutral block
layout: another model's blocks are never read), one checksummed file per block
(`portside.kv_transfer.disk_format`, written under a temporary name and renamed). Under tensor or
pipeline parallelism each rank writes and reads its own part of each block in its own folder (its
fingerprint includes its tp and pp index), so producer and consumer need the same parallel
layout; a block counts as there when every rank's file is, and a load as done when every rank's
is, with the fewest good blocks any rank reported (`portside.kv_transfer.ranks`).

A block that is missing, truncated, corrupt or another block's (a hash collision) stops its
request's load there: the blocks before it are used, the rest recomputed, never wrong KV; a
damaged file is deleted (a producer writes it again), and this instance never tries a block whose
load failed again. The
directory is not pruned: remove old files with the usual tools (files are named
``<hash>.kvb``; a consumer only needs them until its request is scheduled).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from portside.kv_transfer import disk_format
from portside.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVTransferInfo
from portside.kv_transfer.config import KV_ROLES, KVTransferConfig

if TYPE_CHECKING:
    from portside.request import Request
    from portside.sched.output import SchedulerOutput

__all__ = ["SharedStorageMetadata", "SharedStorageScheduler", "resolve_disagg_flags"]

# one block to move: (device block id, block hash, parent hash, token ids)
BlockRef = tuple[int, int, int | None, tuple[int, ...]]

# vLLM's names in --kv-transfer-config
_VLLM_CONNECTORS = {"SharedStorageConnector": "shared_storage", "shared_storage": "shared_storage"}
_VLLM_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
# the other keys of vLLM's KVTransferConfig: accepted (so vLLM command lines work), not used here
_VLLM_IGNORED = {"kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "engine_id",
                 "kv_connector_module_path", "kv_load_failure_policy", "enable_permute_local_kv"}


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    saves: list[BlockRef] = field(default_factory=list)  # written after the step's forward
    loads: dict[str, list[BlockRef]] = field(default_factory=dict)  # req_id -> blocks, in table order; before it


class SharedStorageScheduler(KVConnectorScheduler):
    """Decides which blocks a step saves and loads (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, block_size: int, info: KVTransferInfo) -> None:
        super().__init__(config, block_size, info)
        if config.cpu_bytes or config.disk_path is not None:
            raise ValueError("--kv-connector shared_storage and the KV tiers (--kv-offload-*, --preemption-mode swap) "
                             "are both KV connectors; an engine runs one: drop one of them")
        path = config.option("path")
        assert path, "resolve_disagg_flags requires it"
        # one folder per rank (its part of every block: `KVTransferInfo.parts`)
        self.folders = [disk_format.folder(path, fp) for fp, _ in info.parts]
        self.saves = config.role in ("producer", "both")
        self.loads_kv = config.role in ("consumer", "both")
        self._requests: dict[str, Request] = {}  # producer: requests seen, by id
        self._saved: dict[str, int] = {}  # producer: req_id -> prompt blocks already saved
        self._matched: dict[str, list[BlockRef]] = {}  # consumer: req_id -> blocks found (block id still -1)
        self._loads: dict[str, list[BlockRef]] = {}
        self._inflight: dict[str, list[int]] = {}  # consumer: req_id -> hashes being loaded
        self._bad: set[int] = set()  # consumer: blocks whose load failed: never tried again (computed instead)
        self.counters: dict[str, float] = dict.fromkeys(
            ("saved_blocks", "loaded_blocks", "failed_load_blocks", "corrupt_blocks", "loads", "load_seconds", "load_bytes",
             "save_seconds", "save_bytes"), 0.0)

    def _stored(self, block_hash: int) -> bool:
        """Every rank's file of the block is in the directory."""
        return all(os.path.exists(disk_format.path_of(folder, block_hash)) for folder in self.folders)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.saves:
            self._requests[request.request_id] = request
        if not self.loads_kv:
            return 0
        assert self.kv is not None
        bs = self.block_size
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // bs  # never the last token: its logits are computed
        start = num_computed_tokens // bs
        if start >= max_blocks:
            return 0
        hashes = self.kv.block_hashes(request, max_blocks)
        found: list[BlockRef] = []
        for i in range(start, max_blocks):
            if hashes[i] in self._bad or not self._stored(hashes[i]):
                break
            found.append((-1, hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs])))
        if found:
            self._matched[request.request_id] = found
        return len(found) * bs

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._matched.pop(request.request_id)
        assert len(found) == len(block_ids), (found, block_ids)
        self._loads[request.request_id] = [(b, h, p, t) for b, (_, h, p, t) in zip(block_ids, found, strict=True)]
        self._inflight[request.request_id] = [h for _, h, _, _ in found]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        self._matched.clear()
        saves = self._saves(scheduler_output) if self.saves else []
        if not saves and not self._loads:
            return None
        meta = SharedStorageMetadata(saves, self._loads)
        self._loads = {}
        return meta

    def _saves(self, so: SchedulerOutput) -> list[BlockRef]:
        """The prompt blocks that this step completes, of the requests it runs, not on disk yet."""
        assert self.kv is not None
        bs, saves = self.block_size, []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            upto = min(request.num_prompt_tokens, request.num_computed_tokens + num_tokens) // bs
            start = self._saved.get(req_id, 0)
            if upto <= start:
                continue
            self._saved[req_id] = upto
            hashes = self.kv.block_hashes(request, upto)
            blocks = self.kv.req_to_blocks.get(req_id, [])
            tokens = request.all_token_ids
            for i in range(start, min(upto, len(blocks))):
                if blocks[i].block_id >= 0 and not self._stored(hashes[i]):
                    saves.append((blocks[i].block_id, hashes[i], hashes[i - 1] if i else None,
                                  tuple(tokens[i * bs : (i + 1) * bs])))
        return saves

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for key, value in output.stats.items():
            self.counters[key] = self.counters.get(key, 0.0) + value
        for req_id in output.finished_loading:
            hashes = self._inflight.pop(req_id, [])
            good = output.failed_loading.get(req_id, len(hashes))
            if good < len(hashes):  # the request is looked up again: it must compute from there, not retry
                self._bad.add(hashes[good])

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self._requests.pop(request.request_id, None)
        self._saved.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)

    def on_preempt(self, request: Request, block_ids: list[int]) -> None:
        self._saved.pop(request.request_id, None)  # recomputed from scratch: its blocks are saved again if missing

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)


def resolve_disagg_flags(kv_transfer_config: dict[str, Any] | str | None = None, kv_role: str | None = None,
                         kv_connector: str | None = None, kv_connector_path: str | None = None,
                         ) -> tuple[str, str, tuple[tuple[str, str], ...]] | None:
    """(connector, role, options) for `resolve_kv_transfer_config` from vLLM's --kv-transfer-config
    (JSON text or a dict: kv_connector, kv_role, kv_connector_extra_config.shared_storage_path) and
    portside's --kv-connector / --kv-role / --kv-connector-path (which win); None when none is given.
    ValueError naming the problem."""
    values: dict[str, Any] = {}
    if isinstance(kv_transfer_config, str):
        try:
            kv_transfer_config = json.loads(kv_transfer_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-transfer-config is not valid JSON ({e}); e.g. "
                             '\'{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
                             '"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}\'') from None
    if kv_transfer_config is not None:
        if not isinstance(kv_transfer_config, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        values = dict(kv_transfer_config)
    unknown = sorted(set(values) - {"kv_connector", "kv_role", "kv_connector_extra_config"} - _VLLM_IGNORED)
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)}")
    connector = kv_connector or values.get("kv_connector")
    role = kv_role or values.get("kv_role")
    extra = values.get("kv_connector_extra_config") or {}
    path = kv_connector_path or (extra.get("shared_storage_path") if isinstance(extra, dict) else None)
    if connector is None and role is None and path is None:
        return None
    if connector is None:
        raise ValueError("--kv-role / --kv-connector-path need --kv-connector shared_storage")
    if connector not in _VLLM_CONNECTORS:
        raise ValueError(f"KV connector {connector!r} is not available in portside; use shared_storage "
                         "(vLLM's SharedStorageConnector)")
    role = _VLLM_ROLES.get(role, role) if role is not None else "both"
    if role not in KV_ROLES:
        raise ValueError(f"unknown KV role {role!r}; use producer, consumer or both (vLLM: kv_producer, kv_consumer, "
                         "kv_both)")
    if not path:
        raise ValueError("--kv-connector shared_storage needs a directory: --kv-connector-path DIR (vLLM: "
                         '"kv_connector_extra_config": {"shared_storage_path": DIR})')
    return _VLLM_CONNECTORS[connector], role, (("path", str(path)),)
