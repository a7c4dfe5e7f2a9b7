"""Test-suite settings shared by every directory."""

import os

from hypothesis import settings

# CI runs are reproducible (derandomized examples) and immune to a slow shared machine (no deadline);
# locally hypothesis explores new examples on every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
