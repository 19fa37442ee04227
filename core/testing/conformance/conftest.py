"""Loads the kit's pytest plugin (the --device option and fixtures) when pytest collects this
package. Kept to one import so the plugin module is the single place to read."""

from portside.testing.conformance.plugin import (  # noqa: F401
    conformance_device,
    conformance_dtype,
    conformance_entry,
    conformance_platform,
    conformance_tiny_model,
    pytest_addoption,
)
