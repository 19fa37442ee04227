"""Moved to `portside.testing.tolerances` (shared with the conformance kit); re-exported here."""

from portside.testing.tolerances import (
    KV_CACHE_TOLERANCES,
    KV_ROUND_TRIP,
    TOLERANCES,
    assert_close,
    kv_round_trip_bound,
)

__all__ = ["TOLERANCES", "KV_CACHE_TOLERANCES", "KV_ROUND_TRIP", "assert_close", "kv_round_trip_bound"]
