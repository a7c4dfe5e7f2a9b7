"""The key file the agent gives a server it launches (worker_hooks/sglang/server_key.py) read by SGLang
0.5.23's own argument parsing (`--config`, sglang/srt/server_args.py prepare_server_args): the server
gets the generated key, which is on no command line. No server is started."""

from __future__ import annotations

from sglang.srt.server_args import prepare_server_args

from worker_hooks.sglang.server_key import launch_key


def test_sglang_reads_the_generated_key_from_its_config_file() -> None:
    tail, key = launch_key(["--model-path", "/nonexistent/model", "--device", "cpu"], "")
    assert key not in " ".join(tail)
    args = prepare_server_args(tail)
    assert args.api_key == key
