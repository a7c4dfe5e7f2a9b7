"""The real-SGLang lane (`./dev sglang-test`): every test here imports the sglang package.

tests/conftest.py marks everything under this folder `sglang`, and the default run deselects that
marker; modules are not even collected where sglang is not installed (the project's own .venv), so the
default run never imports it.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
