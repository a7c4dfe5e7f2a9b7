"""Lumen beside unmodified SGLang servers (sglang 0.5.23).

- the sidecar agent (`python -m worker_hooks.sglang`, or `lumen sglang-agent`): agent.py attaches one
  SGLang server to the gateways' control plane as an `engine = "sglang"` worker (agent_config.py,
  agent_role.py, agent_reload.py, server_http.py, holder_report.py, plane_file.py); launcher.py starts,
  watches and restarts the server when the agent is asked to launch it;
- modules SGLang loads into its own server process: the HiCache storage backend (hicache_backend.py
  over page_store.py, which joins page_writer.py and local_holder.py) and the decode-time checkpoint
  plugin (plugin.py, entry point `sglang.srt.plugins: lumen`, over plugin_checkpointer.py,
  plugin_reader.py, plugin_logic.py and plugin_shipper.py).

This package is the only code in Lumen that may import sglang. The agent's modules (agent*.py,
server_http.py, launcher.py, __main__.py) import none of it: the server runs as a child process, and the
launcher only asks the import system whether sglang is installed; any import of sglang they ever need
goes lazily in launcher.py. Modules that SGLang itself loads may import it at the top, so this
`__init__` imports no submodule. The gateway process never imports this package
(tests/unit/test_import_boundaries.py).
"""
