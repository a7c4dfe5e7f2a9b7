"""A seed is never left hung: the time box Lumen's SGLang plugin puts on SGLang's weight-transfer group
set-up (seeded reload, docs/sglang.md "Seeded reload").

A server restarting with `--load-format remote_instance` asks its seed's
`/init_weights_send_group_for_remote_instance`; the seed's scheduler then builds a two-rank process group
with the restarting server (`WeightExporter.init_weights_send_group_for_remote_instance`,
srt/model_executor/model_runner_components/weight_exporter.py, through `init_custom_process_group` in
srt/utils/common.py) and waits in its rendezvous until the restarting server joins, with torch's default
timeout of 30 minutes. While it waits, the seed's scheduler runs nothing: it stops generating, and its
`/ready` still answers 200. A restarting server that never joins (it died, was killed by its agent's
`--seed-timeout-s`, or cannot load that way at all, as on `--device cpu`, where SGLang's
`RemoteInstanceConnector` refuses) left a real seed hung for the whole half hour (seen on CPU: no answer
to `/generate` in 15 s, twice, `/ready` 200).

The plugin wraps `init_custom_process_group` (an AROUND hook, SGLang's `HookRegistry`, which also replaces
the names other modules imported it under) and gives a weight-transfer group (`group_name` starting
`send_weights_`, the seed's and the restarting server's side alike) a timeout of `seed_group_timeout_s`
(`LUMEN_SGLANG_PLUGIN`, default 120 s) when the caller gave none: a rendezvous nobody joins then fails
after it, SGLang's own error path reports the failure to the restarting server (its loader then fails,
and its agent loads from storage) and the seed's scheduler serves again. Only in servers Lumen launched
(a plane file); other groups and explicit timeouts are left alone. The box must exceed the restarting
server's time from its request to its own join (its model initialisation), which is why the default is
generous; the gateway's generation probe of a seed (gateway/server/recovery/reload.py) is the second
line, for a seed stopped for any other reason.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Final

import structlog

from gateway.protocol.plane_file import PLANE_FILE_ENV
from worker_hooks.sglang.plugin_logic import PluginOptions, options_from_env

log = structlog.get_logger("lumen.sglang.plugin")

# the function wrapped (checked against the installed sglang by tests/sglang/test_plugin_paths.py)
SEND_GROUP_HOOK: Final = "sglang.srt.utils.common.init_custom_process_group"
SEND_GROUP_PREFIX: Final = "send_weights_"  # SGLang's remote-instance weight groups, both sides


def group_timeout_s() -> float:
    """The time box from `LUMEN_SGLANG_PLUGIN` (its default when the variable is unusable)."""
    try:
        return options_from_env(os.environ).seed_group_timeout_s
    except ValueError:
        return PluginOptions().seed_group_timeout_s


def boxed_group(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of `init_custom_process_group(backend, init_method, timeout, world_size, rank, store,
    group_name, ...)`: a weight-transfer group without a timeout gets the plugin's."""
    group = kwargs.get("group_name", args[6] if len(args) > 6 else None)
    given = kwargs.get("timeout", args[2] if len(args) > 2 else None)
    if (
        given is None
        and isinstance(group, str)
        and group.startswith(SEND_GROUP_PREFIX)
        and os.environ.get(PLANE_FILE_ENV)
    ):
        seconds = group_timeout_s()
        if len(args) > 2:
            args = (*args[:2], datetime.timedelta(seconds=seconds), *args[3:])
        else:
            kwargs["timeout"] = datetime.timedelta(seconds=seconds)
        log.info("lumen_seed_group_time_boxed", group=group[:120], timeout_s=seconds)
    return original(*args, **kwargs)
