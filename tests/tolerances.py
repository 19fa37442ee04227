"""Moved to `portside.testing.tolerances` (shared with the conformance kit); re-exported here."""

from portside.testing.tolerances import TOLERANCES, assert_close

__all__ = ["TOLERANCES", "assert_close"]
