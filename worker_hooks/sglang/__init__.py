"""Lumen beside unmodified SGLang servers (sglang 0.5.23): the sidecar agent and its launcher.

`python -m worker_hooks.sglang` (or `lumen sglang-agent`) runs one agent beside one SGLang server:
agent.py attaches it to the gateways' control plane as an `engine = "sglang"` worker; launcher.py
starts, watches and restarts the server when the agent is asked to launch it.

This package is the only code in Lumen that may import sglang, and only lazily, in launcher.py, if at
all; today nothing imports it: the server runs as a child process (`python -m sglang.launch_server`).
The gateway process never imports this package (tests/unit/test_import_boundaries.py).
"""
