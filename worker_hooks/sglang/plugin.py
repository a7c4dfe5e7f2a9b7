"""Lumen's SGLang plugin (sglang 0.5.23): decode-time KV checkpoints of running requests, no fork.

SGLang writes KV pages to its storage tier only after prefill (chunks) and when a request ends, never
while it decodes, so a server that dies mid-decode leaves nothing of its generated tokens' KV behind.
This plugin closes the gap the way SGLang's PD decode offload does (`srt/disaggregation/
decode_kvcache_offload_manager.py`, called every step from `srt/managers/scheduler_components/
batch_result_processor.py`), from outside SGLang: SGLang loads it through its general plugin entry
point (group `sglang.srt.plugins`, name `lumen`, `SGLANG_PLUGINS=lumen`) in every process; only the
scheduler processes (one per TP/PP rank) ever run its hook.

This module is that entry point and the hook: `register` hooks `after_decode_result` AFTER
`SchedulerBatchResultProcessor.process_batch_result_decode` (and puts a time box on a seed's
weight-transfer group set-up, plugin_seed.py); the first decode step builds this rank's
`Checkpointer` (plugin_checkpointer.py) from SGLang's runtime context (`build`), which then runs after
every decode step. Pages are read out of the device pool by `KvReader` (plugin_reader.py), in the byte
order SGLang's HiCache host pool gives a page, so the page keys are SGLang's own (`pagekeys` =
`get_hash_str`) and a holder that is an SGLang server with Lumen's HiCache backend restores them byte
for byte.

Supported: what `KvReader` reads (MHA pools in NHD layout without scale buffers and with equal K/V head
dims, MLA pools without layer sharding; host layouts layer_first, page_first, page_first_direct, and
page_head for MHA); TP and PP (rank r sends its shard to shard r of each holder, an MLA cache only from
TP rank 0, as `storage_layout.shard_layout`). Anything else (hybrid SWA/Mamba pools, quantized pools
with scales, HND, context parallelism) turns the plugin off for that server, once, with a log line:
requests then run uncheckpointed, as without the plugin. The hook never raises into SGLang; after
`MAX_HOOK_ERRORS` errors the plugin turns itself off.

Quiet where Lumen did not launch the server: installed in SGLang's environment, the plugin loads in every
server of it, but only a server given a plane file (`LUMEN_PLANE_FILE`, which Lumen's sidecar agent sets
for a server it launches) can send a page, so a server without one turns the plugin off on its first
decode step with one log line (`lumen_plugin_off`, reason `not launched by Lumen`) per scheduler rank.
Every failure the plugin logs is one line (the error and where it was raised), never a traceback:
structlog renders an exception with rich's traceback and its locals, which in SGLang's scheduler ran to
1,402 lines for one missing file.
"""

from __future__ import annotations

import atexit
import os
import threading
import traceback
from typing import Any, Final

import structlog

from gateway.protocol.plane_file import PLANE_FILE_ENV
from worker_hooks.sglang.plugin_checkpointer import Checkpointer
from worker_hooks.sglang.plugin_logic import options_from_env
from worker_hooks.sglang.plugin_reader import Unsupported, reader_for_pool
from worker_hooks.sglang.plugin_seed import SEND_GROUP_HOOK, boxed_group
from worker_hooks.sglang.storage_layout import shard_layout

log = structlog.get_logger("lumen.sglang.plugin")

# the one function hooked, and how (checked against the installed sglang by tests/sglang/test_plugin_paths.py)
DECODE_RESULT_HOOK: Final = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor.process_batch_result_decode"
)
HOOKS: Final = ((DECODE_RESULT_HOOK, "AFTER"), (SEND_GROUP_HOOK, "AROUND"))
MAX_HOOK_ERRORS: Final = 3  # then the plugin turns itself off
NOT_LAUNCHED: Final = f"not launched by Lumen ({PLANE_FILE_ENV} is not set): no checkpoints"


def failure(exc: BaseException) -> str:
    """One line for a log: the error and the innermost place it was raised (file:line in function)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{exc!r}"[:300] + where


def register() -> None:
    """The `sglang.srt.plugins` entry point: hook the decode result processing (applied by SGLang's
    `load_plugins` right after all plugins registered)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DECODE_RESULT_HOOK, after_decode_result, HookType.AFTER)
    # a seed's weight-transfer group set-up is time-boxed (plugin_seed.py)
    HookRegistry.register(SEND_GROUP_HOOK, boxed_group, HookType.AROUND)


def build(processor: Any) -> Checkpointer:
    """The checkpointer of this scheduler rank, from SGLang's result processor and runtime context."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.runtime_context import get_memory, get_parallel

    options = options_from_env(os.environ)
    parallel = get_parallel()
    if is_dp_attention_enabled():
        tp_rank, tp_size = int(parallel.attn_tp_rank), int(parallel.attn_tp_size)
    else:
        tp_rank, tp_size = int(parallel.tp_rank), int(parallel.tp_size)
    if int(parallel.attn_cp_size) > 1 or int(getattr(parallel, "attn_dcp_size", 1)) > 1:
        raise Unsupported("context parallelism")
    pool = processor.token_to_kv_pool_allocator.get_kvcache()
    reader = reader_for_pool(pool, str(get_memory().hicache_mem_layout))
    shards = shard_layout(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=int(parallel.pp_rank),
        pp_size=int(parallel.pp_size),
        rank_replicated=reader.mla,
    )
    ckpt = Checkpointer(
        reader,
        processor.req_to_token_pool.req_to_token,
        options=options,
        write_to=shards.write_to,
        # a rank-replicated (MLA) cache is the same on every TP rank: rank 0 writes it to all of them
        writes=not reader.mla or tp_rank == 0,
        abort_cls=FINISH_ABORT,
    )
    atexit.register(ckpt.close)
    log.info(
        "lumen_plugin_started",
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=int(parallel.pp_rank),
        layout=reader.layout,
        page_size=reader.page_size,
        page_bytes=reader.page_bytes,
        writes=ckpt.writes,
    )
    return ckpt


# -- the hook -------------------------------------------------------------------------------------
class _State:
    def __init__(self) -> None:
        self.plugin: Checkpointer | None = None
        self.off: str | None = None  # why the plugin is off in this process
        self.errors = 0
        self.lock = threading.Lock()

    def get(self, processor: Any) -> Checkpointer | None:
        if self.plugin is not None or self.off is not None:
            return self.plugin
        with self.lock:
            if self.plugin is None and self.off is None:
                if not os.environ.get(PLANE_FILE_ENV):
                    # a server Lumen did not launch: nothing to send pages as, nothing to say but this
                    self.off = NOT_LAUNCHED
                    log.info("lumen_plugin_off", reason=self.off)
                    return None
                try:
                    self.plugin = build(processor)
                except Unsupported as exc:
                    self.off = str(exc)
                    log.warning("lumen_plugin_off", reason=self.off)
                except Exception as exc:  # a runtime context, pool or plane file this plugin cannot use
                    self.off = f"start failed: {failure(exc)}"
                    log.warning("lumen_plugin_off", reason=self.off)
        return self.plugin


_state = _State()


def after_decode_result(ret: Any, processor: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of `process_batch_result_decode(self, batch, result)`: returns None (SGLang keeps the
    original result). Never raises into SGLang: an error is logged, and after a few the plugin stops."""
    if _state.off is not None:
        return None
    try:
        plugin = _state.get(processor)
        if plugin is not None:
            plugin.after_decode(batch)
    except Exception as exc:
        _state.errors += 1
        log.warning("lumen_plugin_hook_failed", errors=_state.errors, error=failure(exc))
        if _state.errors >= MAX_HOOK_ERRORS:
            _state.off = "too many errors"
            log.error("lumen_plugin_off", reason=_state.off)
    return None
