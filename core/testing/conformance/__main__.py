"""`python -m portside.testing.conformance --device NAME [pytest options]`: run the kit.

The same as ``pytest -p portside.testing.conformance.plugin --pyargs portside.testing.conformance
--device NAME``; extra arguments go to pytest (e.g. ``-x``, ``-k attention``).
"""

from __future__ import annotations

import sys

import pytest


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return int(pytest.main(["-p", "portside.testing.conformance.plugin", "--pyargs", "portside.testing.conformance", *args]))


if __name__ == "__main__":
    sys.exit(main())
