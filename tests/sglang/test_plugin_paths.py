"""Lumen's SGLang plugin against the installed sglang 0.5.23 (`./dev sglang-test`, on CPU).

An SGLang upgrade that moves or reshapes what the plugin relies on fails here, loudly:

- every function the plugin hooks exists at its dotted path with the signature the hook assumes, and the
  scheduler still calls it once per decode step; every SGLang name the hook reads (Req and its KV record,
  the pools, the runtime context, the host-layout choices) is still there; the stream ordering that makes
  reading a page safe (every forward waits on the scheduler's stream) still holds;
- the page byte order equals what SGLang's own host-pool code (`get_data_page` of `pool_host/mha.py`,
  `mla.py`, run here on CPU tensors) gives a page, for every supported layout;
- the entry point loads through SGLang's own plugin loader (`load_plugins`, with the `SGLANG_PLUGINS`
  whitelist) and registers an AFTER hook that SGLang's wrapper calls correctly and that never raises into
  SGLang;
- the kv_hints Lumen sends pass SGLang's real request contract and its own envelope decoder, and what
  SGLang keeps on the request parses back to the same instruction.

Modules that need CUDA-only dependencies to import (the batch result processor, the KV pools) are read
as source (ast) from the installed package; where they do import, they are also resolved for real.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import json
import pkgutil
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sglang
import torch

from gateway.protocol.sglang import kv_hints_for, parse_kv_hints
from worker_hooks.sglang import plugin, plugin_seed
from worker_hooks.sglang.plugin import HOOKS, after_decode_result
from worker_hooks.sglang.plugin_reader import MHA_LAYOUTS, MLA_LAYOUTS, KvReader

REPO = Path(__file__).resolve().parents[2]


def source_of(module: str) -> tuple[Path, ast.Module]:
    """The installed module's source, found by path (importing a parent package may need CUDA)."""
    root = Path(sglang.__file__).parent
    rel = Path(*module.split(".")[1:])
    path = next((p for p in (root / rel.with_suffix(".py"), root / rel / "__init__.py") if p.is_file()), None)
    assert path is not None, f"{module} is not in the installed sglang"
    return path, ast.parse(path.read_text())


def class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{cls.name}.{name} not found")


def params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]


def self_attrs(cls: ast.ClassDef) -> set[str]:
    """Attributes a class assigns on self anywhere in its body, plus its annotated class fields."""
    out: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                out.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            out.add(node.name)
    return out


def test_the_installed_sglang_is_the_pinned_one() -> None:
    assert sglang.__version__ == "0.5.23"


# -- the hooked paths -------------------------------------------------------------------------------
def test_every_hooked_path_resolves_with_the_assumed_signature() -> None:
    assert HOOKS == ((plugin.DECODE_RESULT_HOOK, "AFTER"), (plugin_seed.SEND_GROUP_HOOK, "AROUND"))
    for target, _kind in HOOKS[:1]:
        module, cls_name, meth = target.rsplit(".", 2)
        _, tree = source_of(module)
        fn = method(class_def(tree, cls_name), meth)
        # AFTER hooks get (result, *args): the hook's (processor, batch) are the method's (self, batch)
        assert params(fn) == ["self", "batch", "result"], f"{target}: {params(fn)}"
        # resolved the way SGLang's HookRegistry resolves a target, in a child process: importing the
        # batch result processor loads tvm_ffi, with which this pytest process segfaults at exit (rc 139
        # after every test passed)
        probe = (
            "import importlib, inspect, json, pkgutil, sys\n"
            "module, cls_name, meth = sys.argv[1:4]\n"
            "try:\n"
            "    mod = importlib.import_module(module)\n"
            "except ImportError as exc:\n"
            "    print(json.dumps({'import_error': str(exc)})); sys.exit(0)\n"
            "same = pkgutil.resolve_name(module + '.' + cls_name) is getattr(mod, cls_name)\n"
            "sig = inspect.signature(getattr(getattr(mod, cls_name), meth))\n"
            "print(json.dumps({'same': same, 'params': list(sig.parameters)[:3]}))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, module, cls_name, meth], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if "import_error" in got:  # CUDA-only dependencies on a CPU-only lane
            print(f"{module} does not import here ({got['import_error']}); checked from source")
            continue
        assert got == {"same": True, "params": ["self", "batch", "result"]}


def test_the_weight_transfer_group_function_and_its_callers_are_as_the_time_box_assumes() -> None:
    """plugin_seed.boxed_group reads `timeout` (3rd) and `group_name` (7th) by position or keyword; the
    seed's and the restarting server's remote-instance groups are named `send_weights_...` and are
    created without a timeout (torch's 30 minutes)."""
    fn = pkgutil.resolve_name(plugin_seed.SEND_GROUP_HOOK)
    names = list(inspect.signature(fn).parameters)
    assert names[:7] == ["backend", "init_method", "timeout", "world_size", "rank", "store", "group_name"]
    for module in (
        "sglang.srt.model_executor.model_runner_components.weight_exporter",
        "sglang.srt.connector.remote_instance",
    ):
        path, tree = source_of(module)
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "init_custom_process_group"
        ]
        assert calls, f"{module} no longer creates its group with init_custom_process_group"
        for call in calls:
            assert "timeout" not in {k.arg for k in call.keywords}, f"{path}: gives a timeout now"
    src = source_of("sglang.srt.model_loader.remote_instance_weight_loader_utils")[0].read_text()
    assert 'f"send_weights_{remote_instance_weight_loader_client_id}"' in src


@pytest.mark.parametrize("launched", [True, False])
def test_sglangs_around_wrapper_gives_a_weight_group_the_time_box(
    fresh_registry: Any, monkeypatch: pytest.MonkeyPatch, launched: bool
) -> None:
    import datetime

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    mod = types.ModuleType("lumen_stand_in_groups")
    exec(
        textwrap.dedent(
            """
            seen = []
            def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                                          rank=-1, store=None, group_name=None, pg_options=None,
                                          device_id=None):
                seen.append((group_name, timeout))
                return group_name
            """
        ),
        mod.__dict__,
    )
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    if launched:
        monkeypatch.setenv("LUMEN_PLANE_FILE", "/nonexistent/plane.json")
    else:
        monkeypatch.delenv("LUMEN_PLANE_FILE", raising=False)
    monkeypatch.setenv("LUMEN_SGLANG_PLUGIN", '{"seed_group_timeout_s": 7.5}')
    target = f"{mod.__name__}.init_custom_process_group"
    HookRegistry.register(target, plugin_seed.boxed_group, HookType.AROUND)
    HookRegistry._apply_target(target, HookRegistry._hooks[target])
    f = mod.init_custom_process_group
    assert f(backend="nccl", init_method="tcp://h:1", world_size=2, rank=0, group_name="send_weights_a_1_0")
    f("nccl", "tcp://h:1", None, 2, 1, None, "send_weights_b_1_0")  # positionally, as a caller may
    f(backend="nccl", group_name="update_weights")  # another group: left alone
    given = datetime.timedelta(seconds=3)
    f(backend="nccl", group_name="send_weights_c", timeout=given)  # an explicit timeout: left alone
    box = datetime.timedelta(seconds=7.5) if launched else None
    assert mod.seen == [
        ("send_weights_a_1_0", box),
        ("send_weights_b_1_0", box),
        ("update_weights", None),
        ("send_weights_c", given),
    ]


def test_the_scheduler_calls_the_hooked_function_every_decode_step() -> None:
    _, _, meth = plugin.DECODE_RESULT_HOOK.rsplit(".", 2)
    path, _ = source_of("sglang.srt.managers.scheduler")
    src = path.read_text()
    assert f".{meth}(" in src, "the scheduler no longer calls the decode result processing"
    # the stream order that keeps a page's slots unwritten until the plugin's copy has read them
    assert "self.forward_stream.wait_stream(self.schedule_stream)" in src
    assert "StreamContext(self.schedule_stream)" in src


def test_the_names_the_hook_reads_exist() -> None:
    _, sb = source_of("sglang.srt.managers.schedule_batch")
    req = class_def(sb, "Req")
    missing = {
        "rid",
        "kv_hints",
        "origin_input_ids",
        "output_ids",
        "extra_key",
        "cache_salt",
        "is_retracted",
        "finished_reason",
        "finished",
        "kv",
    } - self_attrs(req)
    assert not missing, f"Req lost {missing}"
    assert {"req_pool_idx", "kv_committed_len"} <= self_attrs(class_def(sb, "ReqKvInfo"))
    class_def(sb, "FINISH_ABORT")

    _, brp = source_of("sglang.srt.managers.scheduler_components.batch_result_processor")
    proc = class_def(brp, "SchedulerBatchResultProcessor")
    assert {"token_to_kv_pool_allocator", "req_to_token_pool"} <= self_attrs(proc)

    _, mp = source_of("sglang.srt.mem_cache.memory_pool")
    assert "req_to_token" in self_attrs(class_def(mp, "ReqToTokenPool"))
    assert {"page_size", "layer_shard_enabled"} <= self_attrs(class_def(mp, "KVCache"))
    mha = self_attrs(class_def(mp, "MHATokenToKVPool"))
    assert {"k_buffer", "v_buffer", "head_dim", "v_head_dim", "kv_cache_layout", "k_scale_buffer"} <= mha
    assert {"kv_buffer", "kv_scale_buffer", "kv_cache_dim"} <= self_attrs(class_def(mp, "MLATokenToKVPool"))

    _, alloc = source_of("sglang.srt.mem_cache.allocator.base")
    method(class_def(alloc, "BaseTokenToKVPoolAllocator"), "get_kvcache")

    _, rc = source_of("sglang.srt.runtime_context")
    names = {n.name for n in rc.body if isinstance(n, ast.FunctionDef)}
    assert {"get_memory", "get_parallel"} <= names
    _, dpa = source_of("sglang.srt.layers.dp_attention")
    assert "is_dp_attention_enabled" in {n.name for n in dpa.body if isinstance(n, ast.FunctionDef)}

    _, mem = source_of("sglang.srt.arg_groups.fields.memory")
    text = ast.unparse(mem)
    assert "hicache_mem_layout" in text
    for layout in MHA_LAYOUTS:
        assert repr(layout) in text, f"--hicache-mem-layout lost {layout}"


# -- page byte order = SGLang's host-pool code ------------------------------------------------------
def host_page_fn(module: str, cls_name: str) -> tuple[Any, str]:
    """SGLang's `get_data_page` of a host pool class, compiled from its installed source, and the
    source of its `init_kv_buffer` (for the dims each layout allocates)."""
    _, tree = source_of(module)
    cls = class_def(tree, cls_name)
    fn = method(cls, "get_data_page")
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module([fn], []), f"<{cls_name}.get_data_page>", "exec"), ns)
    return ns["get_data_page"], ast.unparse(method(cls, "init_kv_buffer"))


PS, L, H, D, DIM = 4, 3, 2, 5, 24
HOST_PAGES = 3
HIDX = PS  # the host page used: the second one, so offsets matter


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_page_bytes_equal_sglangs_host_pool_page(layout: str) -> None:
    get_data_page, init_src = host_page_fn("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost")
    dims = {
        "layer_first": "(2, self.layer_num, self.size, self.head_num, self.head_dim)",
        "page_first": "(2, self.size, self.layer_num, self.head_num, self.head_dim)",
        "page_first_direct": "(2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)",
        "page_head": "(2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim)",
    }[layout]
    assert f"dims = {dims}" in init_src.replace("\n", " ").replace("( ", "(").replace(" )", ")"), init_src
    size = HOST_PAGES * PS
    shape = {
        "layer_first": (2, L, size, H, D),
        "page_first": (2, size, L, H, D),
        "page_first_direct": (2, HOST_PAGES, L, PS, H, D),
        "page_head": (2, HOST_PAGES, H, PS, L, D),
    }[layout]
    g = torch.Generator().manual_seed(2)
    k = [torch.randn(64, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    v = [torch.randn(64, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    slots = [33, 34, 35, 36]
    # the host pool after a backup of those slots into host page HIDX (what each dim means)
    host = torch.zeros(shape, dtype=torch.bfloat16)
    for c, bufs in enumerate((k, v)):
        for layer in range(L):
            for t, s in enumerate(slots):
                row, p, off = bufs[layer][s], (HIDX + t) // PS, (HIDX + t) % PS
                if layout == "layer_first":
                    host[c, layer, HIDX + t] = row
                elif layout == "page_first":
                    host[c, HIDX + t, layer] = row
                elif layout == "page_first_direct":
                    host[c, p, layer, off] = row
                else:
                    host[c, p, :, off, layer] = row
    pool = types.SimpleNamespace(layout=layout, kv_buffer=host, page_size=PS)
    want = get_data_page(pool, HIDX, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
    reader = KvReader(mla=False, buffers=[k, v], layout=layout, page_size=PS)
    assert bytes(reader.stage(torch.tensor(slots)).data()) == want


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_page_bytes_equal_sglangs_host_pool_page(layout: str) -> None:
    get_data_page, _ = host_page_fn("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost")
    size = HOST_PAGES * PS
    shape = {
        "layer_first": (L, size, 1, DIM),
        "page_first": (size, L, 1, DIM),
        "page_first_direct": (HOST_PAGES, L, PS, 1, DIM),
    }[layout]
    g = torch.Generator().manual_seed(3)
    kv = [torch.randn(64, 1, DIM, generator=g).to(torch.bfloat16) for _ in range(L)]
    slots = [8, 9, 10, 11]
    host = torch.zeros(shape, dtype=torch.bfloat16)
    for layer in range(L):
        for t, s in enumerate(slots):
            p, off = (HIDX + t) // PS, (HIDX + t) % PS
            if layout == "layer_first":
                host[layer, HIDX + t] = kv[layer][s]
            elif layout == "page_first":
                host[HIDX + t, layer] = kv[layer][s]
            else:
                host[p, layer, off] = kv[layer][s]
    pool = types.SimpleNamespace(layout=layout, kv_buffer=host, page_size=PS)
    pool._storage_page_index = lambda index: index  # no decode context parallelism
    want = get_data_page(pool, HIDX, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
    reader = KvReader(mla=True, buffers=[kv], layout=layout, page_size=PS)
    assert bytes(reader.stage(torch.tensor(slots)).data()) == want


# -- the entry point, through SGLang's loader -------------------------------------------------------
def declared_entry_point() -> importlib.metadata.EntryPoint:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    value = meta["project"]["entry-points"]["sglang.srt.plugins"]["lumen"]
    return importlib.metadata.EntryPoint(name="lumen", value=value, group="sglang.srt.plugins")


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry._hooks.clear()
    HookRegistry._patched.clear()
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    applied: list[bool] = []
    # hooks are applied to a stand-in below, never to this process's SGLang
    monkeypatch.setattr(HookRegistry, "apply_hooks", classmethod(lambda cls: applied.append(True)))
    yield plugins, HookRegistry, applied
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(saved_hooks)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(saved_patched)


def installed_lumen_entry_points() -> list[importlib.metadata.EntryPoint]:
    return [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "lumen"]


@pytest.mark.parametrize("whitelist", ["lumen", "", "other,lumen", "other"])
def test_the_entry_point_loads_through_sglangs_loader(
    fresh_registry: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, whitelist: str
) -> None:
    """SGLang's `load_plugins` discovers the entry point through importlib.metadata, honours the
    whitelist, loads it and runs it. Where this venv's lumen was installed before the entry point was
    declared, a distribution holding just pyproject.toml's declaration stands in for it."""
    plugins, registry, applied = fresh_registry
    if not installed_lumen_entry_points():
        ep = declared_entry_point()
        info = tmp_path / "lumen_entry_point_probe-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lumen-entry-point-probe\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[{ep.group}]\n{ep.name} = {ep.value}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
    assert [e.value for e in installed_lumen_entry_points()] == [declared_entry_point().value]
    monkeypatch.setenv("SGLANG_PLUGINS", whitelist)
    plugins.load_plugins()
    assert applied == [True]
    hooks = registry._hooks.get(plugin.DECODE_RESULT_HOOK, [])
    if whitelist == "other":
        assert hooks == []
        return
    ((kind, fn, source),) = hooks
    assert kind.name == "AFTER" and fn is after_decode_result
    assert source.plugin_name == "lumen"
    ((kind, fn, _),) = registry._hooks.get(plugin_seed.SEND_GROUP_HOOK, [])
    assert kind.name == "AROUND" and fn is plugin_seed.boxed_group


def test_the_installed_metadata_has_the_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if not any(e.name == "lumen" for e in eps):
        pytest.skip("lumen's installed metadata predates the entry point: `pip install -e . --no-deps` here")
    (ep,) = [e for e in eps if e.name == "lumen"]
    assert ep.value == declared_entry_point().value
    assert ep.load() is plugin.register


def test_sglangs_after_wrapper_calls_the_hook_and_it_never_raises(
    fresh_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _, _, _ = fresh_registry
    mod = types.ModuleType("lumen_stand_in_processor")
    exec(
        textwrap.dedent(
            """
            class Processor:
                calls = 0
                def process_batch_result_decode(self, batch, result):
                    Processor.calls += 1
                    return "original"
            """
        ),
        mod.__dict__,
    )
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(plugin, "_state", plugin._State())
    target = f"{mod.__name__}.Processor.process_batch_result_decode"
    HookRegistry.register(target, after_decode_result, HookType.AFTER)
    HookRegistry._apply_target(target, HookRegistry._hooks[target])
    batch = types.SimpleNamespace(reqs=[])
    # positionally and by keyword, as SGLang's scheduler may call it; the plugin cannot start on a
    # stand-in processor: it turns itself off and SGLang's result comes back untouched
    assert mod.Processor().process_batch_result_decode(batch, object()) == "original"
    assert mod.Processor().process_batch_result_decode(batch=batch, result=object()) == "original"
    assert mod.Processor.calls == 2
    assert plugin._state.off is not None and plugin._state.plugin is None


# -- kv_hints against SGLang's real contract ----------------------------------------------------------
def test_kv_hints_pass_sglangs_contract_and_decoder() -> None:
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.managers.kv_hints import KvHintsEnvelope, decode_kv_hints_envelope

    hints = kv_hints_for(
        "f" * 32, epoch=2, src_worker="sgl-0", holders=[("sgl-1", "tcp://10.0.0.2:5600")], first_page=1
    )
    value = msgspec.to_builtins(hints)
    body = {
        "rid": "f" * 32,
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "stream": True,
        "kv_hints": value,
    }
    GenerateRequest.from_json_value(body)  # raises JsonContractError on a violation
    envelope = decode_kv_hints_envelope(value)  # what io_struct stores and Req.kv_hints holds
    assert isinstance(envelope, KvHintsEnvelope)
    parsed = parse_kv_hints(msgspec.to_builtins(envelope))
    assert parsed is not None
    assert (parsed.rid, parsed.epoch, parsed.src_worker, parsed.page_size, parsed.first_page) == (
        "f" * 32,
        2,
        "sgl-0",
        64,
        1,
    )
    assert [h.kv_endpoint for h in parsed.holders] == ["tcp://10.0.0.2:5600"]
