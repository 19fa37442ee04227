"""The backend conformance kit: one suite any platform, in-tree or third-party, runs against itself.

    pytest --pyargs portside.testing.conformance --device NAME

It checks, for the platform registered as NAME:

- probe (`test_probe.py`): `register()` returns ``"module:Class"`` or None and imports nothing
  heavy; `is_available()` is fast, returns an `Availability` with a reason when it says no, and
  initialises no device runtime (checked in a fresh interpreter);
- KV cache (`test_kv_cache.py`): `kv_cache_shape` holds exactly K and V, and `write_kv` /
  `read_kv` round-trip, skipping slot -1 and touching nothing else;
- attention (`test_attention.py`): paged attention against core's reference
  (`portside.attention.reference`) over the standard shape set, for the block sizes and dtypes
  the platform declares; and each attention feature (`ATTENTION_FEATURES`) through
  `ForwardContext.attention`: natively where the backend lists it in `features`, else by core's
  fallback over the backend's own `write_kv`/`read_kv`;
- encoder attention (`test_encoder_attention.py`): `AttentionBackend.encoder_attention`
  (non-causal, packed sequences, no cache) against core's reference in every declared dtype;
- model ops (`test_model_ops.py`): `Platform.model_ops()`'s mixture-of-experts kernels against
  core's references (`portside.ops.moe`) in every declared dtype;
- graph (`test_graph.py`): the platform's graph runner, after `capture`, gives what
  `EagerGraphRunner` gives on a tiny model, step after step;
- communicator (`test_communicator.py`): collectives at world size 1, and 2 in subprocesses
  where the platform's distributed backend can run;
- end to end (`test_end_to_end.py`): greedy output through `LLM(device=NAME)` equals
  transformers' on a tiny random-weight model.

Every failure message starts with ``portside conformance [PART]``, naming the part of the
contract that broke. If NAME is installed but unavailable here, every check but the probe skips
with the platform's reason. The `--device` option and fixtures live in
`portside.testing.conformance.plugin` (loaded by this package's conftest).
"""

from portside.testing.conformance.cases import AttentionCase, standard_cases

__all__ = ["AttentionCase", "standard_cases"]
