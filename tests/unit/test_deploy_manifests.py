"""deploy/kubernetes, checked offline: every overlay renders, every object is valid against the Kubernetes
API schemas `kubernetes-validate` ships, and every command line the containers run exists in Lumen's
CLI (subcommands, flags, `--set` keys and values through the real config loader and validator, LUMEN_*
environment variables), with the topology consistent (every worker attached to every gateway pod,
probes on the right endpoints and ports, Secrets from secret.example.yaml, GPUs requested).

Rendering uses a small kustomize subset written here (`render`: resources, patches, images, namespace;
anything else is refused), so the test needs no binary; when `kustomize` or `kubectl` is on PATH its
output must equal ours. No cluster is involved.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the dev extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra: kubernetes-validate")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
SECRET_EXAMPLE = K8S / "secret.example.yaml"
OVERLAYS = ("synthetic", "sglang")
# the oldest Kubernetes the manifests target (PodDisruptionBudget's unhealthyPodEvictionPolicy: beta in 1.27)
# and the newest schema the installed kubernetes-validate ships
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
CLUSTER_DOMAIN = "cluster.local"


# -- a minimal kustomize ---------------------------------------------------------------------------------


class KustomizeError(Exception):
    pass


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
# strategic-merge keys of the lists our patches may merge (others are replaced, as kustomize does)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}


def render(path: Path) -> list[dict[str, Any]]:
    """The objects `kustomize build path` would print, for the subset of kustomize our overlays use."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = sorted(set(k) - KUSTOMIZATION_KEYS)
    if unknown:
        raise KustomizeError(f"{path}: kustomization keys this renderer does not implement: {unknown}")
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        p = path / res
        if p.is_dir():
            objs += render(p)
        else:
            objs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    for spec in k.get("patches", []):
        _apply_patch(objs, path, spec)
    for img in k.get("images", []):
        _set_image(objs, img)
    if k.get("namespace"):
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    return objs


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    unknown = set(target) - {"kind", "name"}
    if unknown:
        raise KustomizeError(f"patch target keys this renderer does not implement: {sorted(unknown)}")
    return obj["kind"] == target.get("kind", obj["kind"]) and obj["metadata"]["name"] == target.get(
        "name", obj["metadata"]["name"]
    )


def _apply_patch(objs: list[dict[str, Any]], base: Path, spec: dict[str, Any]) -> None:
    if set(spec) - {"path", "target"}:
        raise KustomizeError(f"patch keys this renderer does not implement: {sorted(spec)}")
    doc = yaml.safe_load((base / spec["path"]).read_text())
    if isinstance(doc, list):  # a JSON 6902 patch
        if "target" not in spec:
            raise KustomizeError(f"{spec['path']}: a JSON patch needs a target")
        hits = [o for o in objs if _matches(o, spec["target"])]
        for o in hits:
            for op in doc:
                _json_patch(o, op)
    else:
        target = spec.get("target") or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
        hits = [o for o in objs if _matches(o, target)]
        for i, o in enumerate(objs):
            if any(o is h for h in hits):
                objs[i] = _merge(o, doc, None)
    if not hits:
        raise KustomizeError(f"patch {spec['path']} matches no object")


def _merge(base: Any, patch: Any, field_name: str | None) -> Any:
    """Strategic merge, the subset used here: maps merge, lists in MERGE_KEYS merge by key, null deletes."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if any(str(k).startswith("$") for k in patch):
            raise KustomizeError(f"strategic-merge directives are not implemented: {sorted(patch)}")
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field_name in MERGE_KEYS:
        key = MERGE_KEYS[field_name]
        out_list = [copy.deepcopy(b) for b in base]
        for item in patch:
            at = next((i for i, b in enumerate(out_list) if b.get(key) == item.get(key)), None)
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = _merge(out_list[at], item, None)
        return out_list
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json_patch(obj: dict[str, Any], op: dict[str, Any]) -> None:
    *parents, last = _pointer(op["path"])
    node: Any = obj
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    kind = op["op"]
    if kind not in ("add", "replace", "remove"):
        raise KustomizeError(f"JSON patch op {kind!r} is not implemented")
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            del node[int(last)]
    elif kind == "remove":
        del node[last]
    else:
        if kind == "replace" and last not in node:
            raise KustomizeError(f"replace of a missing path {op['path']}")
        node[last] = copy.deepcopy(op["value"])


def _image_name(image: str) -> tuple[str, str]:
    """(name, the rest: ':tag' / '@digest' / '')."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_image(objs: list[dict[str, Any]], img: dict[str, Any]) -> None:
    if set(img) - {"name", "newName", "newTag", "digest"}:
        raise KustomizeError(f"images keys this renderer does not implement: {sorted(img)}")
    for c in _all_containers(objs):
        name, rest = _image_name(c["image"])
        if name != img["name"]:
            continue
        if "digest" in img:
            rest = "@" + img["digest"]
        elif "newTag" in img:
            rest = f":{img['newTag']}"
        c["image"] = img.get("newName", name) + rest


def _all_containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from _all_containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _all_containers(item)


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def kustomize_binary() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


# -- the containers' command lines -------------------------------------------------------------------------

SECRET_ENV = {"LUMEN_CONTROL_TOKEN", "LUMEN_API_KEYS", "LUMEN_ADMIN_API_KEYS", "LUMEN_ADMIN_API_KEY"}
# where each program reads its environment: a LUMEN_* variable a manifest sets must be read there
ENV_READERS = {
    "gateway": ("gateway/config/loader.py",),
    "cluster-up": ("gateway/config/loader.py",),
    "worker": ("gateway/cli/__init__.py", "gateway/protocol/secrets.py"),
    "sglang-agent": ("worker_hooks/sglang/__main__.py", "gateway/protocol/secrets.py"),
    "sglang-server": (),
}
# the SGLang 0.5.23 launch_server flags a manifest may use: each one is named in Lumen's own record of
# SGLang's interface (docs/sglang.md, worker_hooks/sglang/launcher.py; sglang is not installed here)
SGLANG_FLAGS = {
    "--model-path",
    "--host",
    "--port",
    "--tp-size",
    "--sampling-backend",
    "--enable-deterministic-inference",
    "--page-size",
    "--incremental-streaming-output",
    "--max-running-requests",
    "--enable-priority-scheduling",
    "--schedule-low-priority-values-first",
    "--disable-priority-preemption",
}
# values the kubelet would substitute for the downward API in `$(VAR)` references
DOWNWARD_SAMPLES = {
    "status.podIP": "10.1.2.3",
    "spec.nodeName": "node-a",
}


@dataclass
class Container:
    """One container of one rendered pod template, with what its checks need."""

    where: str
    obj: dict[str, Any]
    pod: dict[str, Any]
    spec: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def env(self) -> list[dict[str, Any]]:
        return self.spec.get("env", [])

    def problem(self, text: str) -> None:
        self.problems.append(f"{self.where}: {text}")

    def env_value(self, entry: dict[str, Any]) -> str:
        """A value of the shape the kubelet would give (secrets: sample values that pass validation)."""
        if "value" in entry:
            return str(entry["value"])
        src = entry.get("valueFrom", {})
        if "secretKeyRef" in src:
            return {
                "control-token": "t" * 43,
                "api-keys": "client-key-0001,client-key-0002",
                "admin-api-keys": "admin-key-0001",
            }.get(src["secretKeyRef"]["key"], "secret-value-0001")
        path = src.get("fieldRef", {}).get("fieldPath", "")
        if path == "metadata.name":
            return f"{self.obj['metadata']['name']}-0"
        if path == "metadata.namespace":
            return self.obj["metadata"].get("namespace", "default")
        return DOWNWARD_SAMPLES.get(path, "sample")

    def argv(self) -> list[str]:
        """command + args with the kubelet's `$(VAR)` expansion (an undefined VAR is a problem: the
        kubelet would pass it literally)."""
        defined = {e["name"]: self.env_value(e) for e in self.env}

        def expand(text: str) -> str:
            def one(m: re.Match[str]) -> str:
                if m.group(1) not in defined:
                    self.problem(f"$({m.group(1)}) is not defined in the container's env")
                    return m.group(0)
                return defined[m.group(1)]

            return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)

        return [expand(str(a)) for a in [*self.spec.get("command", []), *self.spec.get("args", [])]]

    def mount_for(self, path: str) -> dict[str, Any] | None:
        """The volume (with its mount) that `path` lies in, or None."""
        best = None
        for m in self.spec.get("volumeMounts", []):
            mp = m["mountPath"].rstrip("/")
            if (path == mp or path.startswith(mp + "/")) and (
                best is None or len(mp) > len(best["mountPath"])
            ):
                best = m
        if best is None:
            return None
        vol = next((v for v in self.pod.get("volumes", []) if v["name"] == best["name"]), None)
        return {"mount": best, "volume": vol}


def containers(objs: list[dict[str, Any]], overlay: str = "") -> list[Container]:
    out = []
    for o in objs:
        pod = o.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        for c in pod.get("containers", []):
            out.append(Container(f"{overlay}/{o['kind']}/{o['metadata']['name']}/{c['name']}", o, pod, c))
    return out


def program(argv: list[str]) -> str:
    if argv[:1] == ["lumen"] and len(argv) > 1:
        if argv[1:3] == ["cluster", "up"]:
            return "cluster-up"
        return argv[1]
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1:3] == ["-m", "sglang.launch_server"]:
        return "sglang-server"
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1:3] == ["-m", "worker_hooks.sglang"]:
        return "sglang-agent"
    return "?"


@contextlib.contextmanager
def captured() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
        yield buf


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


def _source_text(rel: str) -> str:
    return (ROOT / rel).read_text()


def image_path(path: str) -> Path | None:
    """Where a path inside the `lumen` image comes from in this repository (the Dockerfile copies it to
    /opt/lumen), or None."""
    prefix = "/opt/lumen/"
    text = DOCKERFILE.read_text()
    if not path.startswith(prefix) or "WORKDIR /opt/lumen" not in text:
        return None
    top = path[len(prefix) :].split("/", 1)[0]
    if not re.search(rf"^COPY .*\b{re.escape(top)}\b", text, re.M):
        return None
    return ROOT / path[len(prefix) :]


def check_env(c: Container, prog: str) -> None:
    readers = "\n".join(_source_text(r) for r in ENV_READERS.get(prog, ()))
    args_text = " ".join(str(a) for a in [*c.spec.get("command", []), *c.spec.get("args", [])])
    for e in c.env:
        name = e["name"]
        if name.startswith("LUMEN_"):
            if f'"{name}"' not in readers and f"'{name}'" not in readers:
                c.problem(
                    f"env {name}: not read by {prog} ({', '.join(ENV_READERS.get(prog, ())) or 'nothing'})"
                )
        elif f"$({name})" not in args_text:
            c.problem(f"env {name}: neither a LUMEN_* variable nor used in the arguments")
        if name in SECRET_ENV and "secretKeyRef" not in e.get("valueFrom", {}):
            c.problem(f"env {name}: a secret must come from a Secret (secretKeyRef), never a literal")


def check_secret_refs(c: Container, secrets: dict[str, set[str]]) -> None:
    for e in c.env:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["key"] not in secrets.get(ref["name"], set()):
            c.problem(f"env {e['name']}: Secret {ref['name']} key {ref['key']} is not in secret.example.yaml")
    for v in c.pod.get("volumes", []):
        sec = v.get("secret")
        if sec is None:
            continue
        if sec["secretName"] not in secrets:
            c.problem(f"volume {v['name']}: Secret {sec['secretName']} is not in secret.example.yaml")
            continue
        for item in sec.get("items", []):
            if item["key"] not in secrets[sec["secretName"]]:
                c.problem(
                    f"volume {v['name']}: Secret {sec['secretName']} key {item['key']} is not in secret.example.yaml"
                )


def _file_behind(c: Container, path: str, tmp: Path) -> Path | None:
    """A stand-in file for `path` inside the container: it must lie in a mounted volume (a Secret's
    file must be one of its items) or in the image (/opt/lumen, from this repository)."""
    local = image_path(path)
    if local is not None:
        if not local.exists():
            c.problem(f"{path}: the image has no such file ({local} is missing)")
        return local
    at = c.mount_for(path)
    if at is None:
        c.problem(f"{path}: not inside any volumeMount of the container, nor in the image")
        return None
    vol = at["volume"]
    if vol is None:
        c.problem(f"{path}: volumeMount {at['mount']['name']} has no volume")
        return None
    rel = path[len(at["mount"]["mountPath"].rstrip("/")) + 1 :]
    sec = vol.get("secret")
    if sec is not None and "items" in sec and rel not in {i["path"] for i in sec["items"]}:
        c.problem(f"{path}: Secret volume {vol['name']} does not project {rel}")
    stand_in = tmp / re.sub(r"[^A-Za-z0-9._-]", "_", path)
    stand_in.write_text("stand-in\n")
    return stand_in


def check_gateway_cli(c: Container, argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    """Run `lumen gateway|cluster up ARGS` through gateway.cli.main up to the loaded, validated config
    (the server itself is not started)."""
    import gateway.cli as cli
    import gateway.cli.common as cli_common
    import gateway.cluster.fleet_run as fleet_run
    import gateway.server.logs as logs
    import gateway.server.runner as runner
    from gateway.config import parse_set
    from gateway.config.sections import Config

    args = list(argv[1:])
    # --set keys must exist in the config schema (sections.py dataclasses)
    sections = typing.get_type_hints(Config)
    for i, a in enumerate(args):
        item = a.split("=", 1)[1] if a.startswith("--set=") else (args[i + 1] if a == "--set" else None)
        if item is None:
            continue
        try:
            ((key, value),) = parse_set([item]).items()
        except Exception as exc:
            c.problem(f"--set {item}: {exc}")
            continue
        section, _, name = key.partition(".")
        cls = sections.get(section)
        if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
            c.problem(f"--set {key}: no such config key (gateway/config/sections.py)")
        if isinstance(value, str) and value.startswith("/"):
            local = _file_behind(c, value, tmp)
            if local is not None:
                item = f"{key}={json.dumps(str(local))}"
                if a.startswith("--set="):
                    args[i] = f"--set={item}"
                else:
                    args[i + 1] = item
    for i, a in enumerate(args):
        if a.startswith("--config="):
            local = _file_behind(c, a.split("=", 1)[1], tmp)
            args[i] = f"--config={local}" if local else a
        elif a.startswith("--log-dir="):
            d = a.split("=", 1)[1]
            at = c.mount_for(d)
            if at is None or at["volume"] is None or "emptyDir" not in at["volume"]:
                c.problem(f"--log-dir {d}: not in a writable emptyDir volume")
            args[i] = f"--log-dir={tmp / 'logs'}"
    for name in [n for n in os.environ if n.startswith("LUMEN_")]:
        monkeypatch.delenv(name)
    for e in c.env:
        monkeypatch.setenv(e["name"], c.env_value(e))
    started: list[Any] = []
    monkeypatch.setattr(cli_common, "run_async", lambda coro: started.append(coro))
    monkeypatch.setattr(runner, "run_gateway", lambda cfg, **kw: cfg)  # kw: the SIGHUP loader
    monkeypatch.setattr(fleet_run, "run_fleet", lambda cfg, *a, **kw: cfg)
    monkeypatch.setattr(logs, "configure_logging", lambda *a, **kw: None)
    with captured() as err:
        try:
            rc = cli.main(args)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
    if rc != 0 or not started:
        c.problem(f"`lumen {' '.join(argv[1:])}` refused: {_last_line(err.getvalue())}")
        return
    cfg = started[0]
    port = cfg.gateway.port
    ports = {p.get("name"): p["containerPort"] for p in c.spec.get("ports", [])}
    if ports.get("http") != port:
        c.problem(f"the gateway serves HTTP on {port}, the container port named http is {ports.get('http')}")
    if cfg.gateway.host != "0.0.0.0":
        c.problem(f"gateway.host is {cfg.gateway.host}: unreachable from other pods")
    if (
        argv[1] == "gateway"
        and cfg.gateway.control_host != "127.0.0.1"
        and ports.get("control") != cfg.gateway.control_port
    ):
        c.problem(f"control port {cfg.gateway.control_port} is not the container port named control")


def check_agent_cli(c: Container, argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    """`lumen sglang-agent ARGS` through the agent's own parser, its token and its CA."""
    import gateway.cli as cli
    from gateway.protocol.secrets import resolve_token
    from worker_hooks.sglang.__main__ import parse

    routed: list[list[str]] = []
    monkeypatch.setattr(cli, "exec_sglang_agent", lambda rest: routed.append(rest) or 0)
    cli.main(argv[1:])
    if routed != [argv[2:]]:
        c.problem("`lumen sglang-agent` does not hand its arguments to the agent")
    with captured() as err:
        try:
            parse(argv[2:])
        except SystemExit:
            c.problem(f"`lumen {' '.join(argv[1:])}` refused: {_last_line(err.getvalue())}")
            return
    env = {e["name"]: c.env_value(e) for e in c.env}
    if not resolve_token(env, None):
        c.problem("the agent has no control token (LUMEN_CONTROL_TOKEN or LUMEN_CONTROL_TOKEN_FILE)")
    if "LUMEN_CONTROL_CA" in env:
        _file_behind(c, env["LUMEN_CONTROL_CA"], tmp)


def check_worker_cli(c: Container, argv: list[str]) -> None:
    import gateway.cli as cli

    with captured() as err:
        try:
            _, rest = cli.build_parser().parse_known_args(argv[1:])
        except SystemExit:
            c.problem(f"`lumen {' '.join(argv[1:])}` refused: {_last_line(err.getvalue())}")
            return
    if rest:
        c.problem(f"`lumen worker`: unknown arguments {rest}")


def check_sglang_server(c: Container, argv: list[str]) -> None:
    from worker_hooks.sglang.launcher import REQUIRED_FLAGS

    record = _source_text("docs/sglang.md") + _source_text("worker_hooks/sglang/launcher.py")
    flags: dict[str, str] = {}
    rest = argv[3:]
    for i, a in enumerate(rest):
        if not a.startswith("--"):
            continue
        name, eq, value = a.partition("=")
        if not eq and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value = rest[i + 1]
        flags[name] = value
        if name not in SGLANG_FLAGS or name not in record:
            c.problem(f"sglang.launch_server {name}: not a flag Lumen's SGLang record (docs/sglang.md) names")
    for name, value in REQUIRED_FLAGS:
        if name not in flags:
            c.problem(f"sglang.launch_server lacks {name} (replay failover needs it; docs/sglang.md)")
        elif value is not None and flags[name] != value:
            c.problem(f"sglang.launch_server {name} {flags[name]}: Lumen needs {value}")
    if flags.get("--host") != "0.0.0.0":
        c.problem("sglang.launch_server must listen on 0.0.0.0: the gateways stream from it")
    gpus = c.spec.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if str(gpus) != flags.get("--tp-size", "1"):
        c.problem(f"nvidia.com/gpu limit {gpus} differs from --tp-size {flags.get('--tp-size', '1')}")
    if c.spec.get("resources", {}).get("requests", {}).get("nvidia.com/gpu") != gpus:
        c.problem("nvidia.com/gpu: requests and limits must be equal")


def check_cli(
    objs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp: Path, overlay: str = ""
) -> list[str]:
    """Every problem with the command lines, environment and files of every container in `objs`."""
    secrets = {
        d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
        for d in yaml.safe_load_all(SECRET_EXAMPLE.read_text())
        if d
    }
    problems: list[str] = []
    for c in containers(objs, overlay):
        argv = c.argv()
        prog = program(argv)
        if prog in ("gateway", "cluster-up"):
            check_gateway_cli(c, argv, monkeypatch, tmp)
        elif prog == "sglang-agent":
            check_agent_cli(c, argv, monkeypatch, tmp)
        elif prog == "worker":
            check_worker_cli(c, argv)
        elif prog == "sglang-server":
            check_sglang_server(c, argv)
        else:
            c.problem(f"unknown program {argv[:3]}")
        check_env(c, prog)
        check_secret_refs(c, secrets)
        hook = c.spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if hook is not None and hook[:1] != ["sleep"]:
            c.problem(f"preStop {hook}: only `sleep` is expected")
        problems += c.problems
    return problems


# -- topology ----------------------------------------------------------------------------------------------


def _by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _labels(o: dict[str, Any]) -> dict[str, str]:
    return o["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _flag_values(argv: list[str], flag: str) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
    return out


def check_topology(objs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    workloads = [o for o in objs if o["kind"] in ("StatefulSet", "Deployment")]
    services = _by_kind(objs, "Service")
    for w in workloads:
        name = w["metadata"]["name"]
        if not _selects(w["spec"]["selector"]["matchLabels"], _labels(w)):
            problems.append(f"{name}: its selector does not match its pod labels")
        if not any(
            _selects(p["spec"]["selector"]["matchLabels"], _labels(w))
            for p in _by_kind(objs, "PodDisruptionBudget")
        ):
            problems.append(f"{name}: no PodDisruptionBudget covers its pods")
        if w["kind"] == "StatefulSet":
            gov = next((s for s in services if s["metadata"]["name"] == w["spec"]["serviceName"]), None)
            if gov is None or gov["spec"].get("clusterIP") != "None":
                problems.append(
                    f"{name}: serviceName {w['spec']['serviceName']} is not a headless Service here"
                )
        for c in w["spec"]["template"]["spec"]["containers"]:
            ports = {p.get("name") for p in c.get("ports", [])} | {
                p["containerPort"] for p in c.get("ports", [])
            }
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c.get(probe, {}).get("httpGet")
                if get is not None and get["port"] not in ports:
                    problems.append(f"{name}/{c['name']} {probe}: port {get['port']} is not a container port")
            image = c["image"]
            tag = _image_name(image)[1]
            if not tag or tag == ":latest":
                problems.append(
                    f"{name}/{c['name']}: image {image} has no pinned tag (set by the overlay's images:)"
                )
    for s in services:
        if not any(_selects(s["spec"]["selector"], _labels(w)) for w in workloads):
            problems.append(f"Service {s['metadata']['name']}: selects no pods")
        for p in s["spec"]["ports"]:
            targets = [
                port
                for w in workloads
                if _selects(s["spec"]["selector"], _labels(w))
                for c in w["spec"]["template"]["spec"]["containers"]
                for port in c.get("ports", [])
                if port.get("name") == p["targetPort"] or port["containerPort"] == p["targetPort"]
            ]
            if not targets:
                problems.append(
                    f"Service {s['metadata']['name']}: targetPort {p['targetPort']} is no container port"
                )
            elif any(t["containerPort"] != p["port"] for t in targets):
                problems.append(
                    f"Service {s['metadata']['name']}: port {p['port']} differs from its container port"
                )

    gateways = [w for w in workloads if _labels(w).get("app.kubernetes.io/component") == "gateway"]
    if len(gateways) != 1:
        return [*problems, f"expected one gateway workload, found {len(gateways)}"]
    gw = gateways[0]
    if gw["spec"]["replicas"] < 2:
        problems.append("the gateways need >= 2 replicas")
    gw_c = next(c for c in gw["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway")
    if gw_c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/health":
        problems.append("gateway readiness must probe /health (503 without a healthy worker)")
    if gw_c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/metrics":
        problems.append("gateway liveness must probe /metrics (always 200 while the gateway answers)")
    pdb = next(
        p
        for p in _by_kind(objs, "PodDisruptionBudget")
        if _selects(p["spec"]["selector"]["matchLabels"], _labels(gw))
    )
    if pdb["spec"].get("minAvailable") != 1:
        problems.append("the gateways' PodDisruptionBudget must keep minAvailable 1")

    # every agent attaches to every gateway pod, by the stable names of the gateways' headless Service
    ns = gw["metadata"].get("namespace", "default")
    control = next(s for s in services if s["metadata"]["name"] == gw["spec"]["serviceName"])
    if not control["spec"].get("publishNotReadyAddresses"):
        problems.append("the gateways' headless Service must publish not-ready pods (ready needs a worker)")
    control_port = next(p["port"] for p in control["spec"]["ports"] if p["name"] == "control")
    gw_argv = Container("gateway", gw, gw["spec"]["template"]["spec"], gw_c).argv()
    expected = {
        f"{gw['metadata']['name']}-{i}.{control['metadata']['name']}.{ns}.svc.{CLUSTER_DOMAIN}:{control_port}"
        for i in range(gw["spec"]["replicas"])
    }
    for w in workloads:
        for c in containers([w]):
            argv = c.argv()
            if program(argv) != "sglang-agent":
                continue
            got = _flag_values(argv, "--gateway")
            if set(got) != expected or len(got) != len(expected):
                problems.append(
                    f"{c.where}: --gateway {sorted(got)} must name every gateway pod: {sorted(expected)}"
                )
            if _flag_values(gw_argv, "--control-port") != [str(control_port)]:
                problems.append(
                    f"the gateways' --control-port must be the control Service's port {control_port}"
                )
            server = next(
                (
                    s
                    for s in w["spec"]["template"]["spec"]["containers"]
                    if program(Container("", w, {}, s).argv()) == "sglang-server"
                ),
                None,
            )
            urls = _flag_values(argv, "--url")
            if server is None or not urls:
                problems.append(f"{c.where}: no SGLang server container beside the agent")
                continue
            port = _flag_values(server.get("args", []), "--port")
            if not urls[0].endswith(f":{port[0] if port else ''}") or "10.1.2.3" not in urls[0]:
                problems.append(
                    f"{c.where}: --url {urls[0]} must be the pod IP and the server's --port {port}"
                )
            probes = {
                p: server.get(p, {}).get("httpGet", {}).get("path")
                for p in ("startupProbe", "readinessProbe", "livenessProbe")
            }
            if probes != {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}:
                problems.append(
                    f"{c.where}: SGLang probes {probes}: startup and readiness /ready (cheap), liveness /health"
                )
            if (
                not any(a.startswith("--set=gateway.control_tls_cert=") for a in gw_argv)
                and "--insecure" not in gw_argv
            ):
                problems.append("workers attach over the pod network: the gateways' control plane needs TLS")
    return problems


# -- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_are_valid_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objs = rendered[overlay]
    assert objs
    errors = []
    for version in K8S_VERSIONS:
        for obj in objs:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{version} {_key(obj)} {'.'.join(map(str, exc.path))}: {exc.message}")
    assert not errors, "\n".join(errors)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Service", "PodDisruptionBudget", "Namespace"} <= kinds
    assert len({_key(o) for o in objs}) == len(objs), "two objects with one name"


def test_secret_example_is_valid_and_holds_only_placeholders() -> None:
    for d in yaml.safe_load_all(SECRET_EXAMPLE.read_text()):
        kubernetes_validate.validate(d, K8S_VERSIONS[-1], strict=True)
        assert all(str(v).startswith("REPLACE-ME") for v in d["stringData"].values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_line_exists_in_the_cli(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert check_cli(rendered[overlay], monkeypatch, tmp_path, overlay) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_topology(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    assert check_topology(rendered[overlay]) == []


def test_sglang_overlay_shape(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["sglang"]
    sts = {o["metadata"]["name"]: o for o in _by_kind(objs, "StatefulSet")}
    pod = sts["lumen-sglang"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["sglang", "lumen-agent"]  # the agent as a sidecar
    assert {c["image"].split(":")[0] for c in pod["containers"]} == {
        "lmsysorg/sglang",
        "registry.example.com/lumen",
    }
    assert pod["containers"][0]["image"].endswith(":v0.5.23")  # pinned sglang==0.5.23
    # the gateways' TLS key never reaches a worker pod: only ca.crt is projected there
    for v in pod["volumes"]:
        if "secret" in v:
            assert [i["key"] for i in v["secret"]["items"]] == ["ca.crt"]


def test_the_gateway_routes_the_probes_use_exist() -> None:
    app = _source_text("gateway/server/app.py")
    assert 'add_get("/health", self.handle_health)' in app
    assert 'add_get("/metrics", self.handle_metrics)' in app
    assert "200 if healthy else 503" in app  # readiness means: at least one healthy worker


def test_dockerfile_gateway_image_has_no_torch() -> None:
    text = DOCKERFILE.read_text()
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    stages: dict[str, list[str]] = {}
    for ln in code:
        if ln.startswith("FROM "):
            stages[ln.split(" AS ")[-1].strip()] = []
        elif stages:
            stages[list(stages)[-1]].append(ln)
    assert list(stages) == ["lumen", "lumen-torch"]
    assert "torch" not in "\n".join(stages["lumen"])
    torch_stage = "\n".join(stages["lumen-torch"])
    assert "torch==2.13.0" in torch_stage and "download.pytorch.org/whl/cpu" in torch_stage
    assert 'torch = ["torch==2.13.0"' in _source_text("pyproject.toml")  # the same pin as the extra


def test_renderer_matches_kustomize() -> None:
    cmd = kustomize_binary()
    if cmd is None:
        pytest.skip("neither kustomize nor kubectl on PATH")
    for overlay in OVERLAYS:
        out = subprocess.run(
            [*cmd, str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        theirs = {_key(d): d for d in yaml.safe_load_all(out.stdout) if d}
        ours = {_key(d): d for d in render(K8S / "overlays" / overlay)}
        assert theirs == ours, overlay


# -- the checkers catch what they are for ------------------------------------------------------------------


def _mutated(
    objs: list[dict[str, Any]], kind: str, name: str, container: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    objs = copy.deepcopy(objs)
    o = next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)
    c = next(c for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == container)
    return objs, c


PLANTS = [
    ("gateway flag", "lumen-gateway", "gateway", lambda c: c["args"].append("--no-such-flag"), "refused"),
    (
        "config key",
        "lumen-gateway",
        "gateway",
        lambda c: c["args"].append("--set=gateway.no_such_key=1"),
        "no such config key",
    ),
    (
        "config value",
        "lumen-gateway",
        "gateway",
        lambda c: c["args"].append("--set=recovery.theta=-1"),
        "refused",
    ),
    (
        "plaintext control plane",
        "lumen-gateway",
        "gateway",
        lambda c: c.update(args=[a for a in c["args"] if "control_tls" not in a]),
        "refused",
    ),
    ("agent flag", "lumen-sglang", "lumen-agent", lambda c: c["args"].append("--gatway=x:1"), "refused"),
    (
        "env name",
        "lumen-sglang",
        "lumen-agent",
        lambda c: c["env"].append({"name": "LUMEN_CONTROL_TOKN", "value": "x"}),
        "not read by sglang-agent",
    ),
    (
        "literal secret",
        "lumen-gateway",
        "gateway",
        lambda c: c["env"].append({"name": "LUMEN_ADMIN_API_KEY", "value": "admin-key-0001"}),
        "never a literal",
    ),
    (
        "undefined $(VAR)",
        "lumen-sglang",
        "lumen-agent",
        lambda c: c["args"].append("--id=$(NOPE)"),
        "not defined",
    ),
    (
        "sglang flag",
        "lumen-sglang",
        "sglang",
        lambda c: c["args"].append("--enable-deterministic-inferenc"),
        "not a flag",
    ),
    (
        "missing sampling backend",
        "lumen-sglang",
        "sglang",
        lambda c: c.update(args=[a for a in c["args"] if "sampling-backend" not in a]),
        "lacks --sampling-backend",
    ),
    (
        "secret key",
        "lumen-gateway",
        "gateway",
        lambda c: c["env"][0]["valueFrom"]["secretKeyRef"].update(key="no-such-key"),
        "not in secret.example.yaml",
    ),
    (
        "unmounted file",
        "lumen-gateway",
        "gateway",
        lambda c: c["args"].append('--set=gateway.control_tls_cert="/nowhere/tls.crt"'),
        "not inside any volumeMount",
    ),
]


@pytest.mark.parametrize("what,name,container,plant,expect", PLANTS, ids=[p[0] for p in PLANTS])
def test_cli_checker_catches_a_planted_error(
    rendered: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    what: str,
    name: str,
    container: str,
    plant: Any,
    expect: str,
) -> None:
    objs, c = _mutated(rendered["sglang"], "StatefulSet", name, container)
    plant(c)
    problems = check_cli(objs, monkeypatch, tmp_path)
    assert any(expect in p for p in problems), problems


def test_topology_checker_catches_a_gateway_the_workers_miss(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objs = copy.deepcopy(rendered["sglang"])
    next(o for o in objs if o["metadata"]["name"] == "lumen-gateway" and o["kind"] == "StatefulSet")["spec"][
        "replicas"
    ] = 3
    assert any("must name every gateway pod" in p for p in check_topology(objs))
    objs, c = _mutated(rendered["sglang"], "StatefulSet", "lumen-gateway", "gateway")
    c["readinessProbe"]["httpGet"]["port"] = "nope"
    assert any("is not a container port" in p for p in check_topology(objs))


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="commonLabels"):
        render(tmp_path)


def test_renderer_patches_as_kustomize_does() -> None:
    base = {
        "kind": "StatefulSet",
        "metadata": {"name": "s"},
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "a", "args": ["x"], "env": [{"name": "E", "value": "1"}]}]}
            }
        },
    }
    merged = _merge(
        base,
        {
            "spec": {
                "template": {
                    "spec": {"containers": [{"name": "a", "args": ["y"]}, {"name": "b", "image": "i"}]}
                }
            }
        },
        None,
    )
    cs = merged["spec"]["template"]["spec"]["containers"]
    assert cs == [
        {"name": "a", "args": ["y"], "env": [{"name": "E", "value": "1"}]},
        {"name": "b", "image": "i"},
    ]
    assert base["spec"]["template"]["spec"]["containers"][0]["args"] == ["x"]  # the base is left alone
    _json_patch(merged, {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "z"})
    assert cs[0]["args"] == ["y", "z"]
    assert _image_name("reg.io:5000/lumen:0.1") == ("reg.io:5000/lumen", ":0.1")
    assert _image_name("lumen") == ("lumen", "")


def test_argparse_is_what_the_cli_uses() -> None:
    """The checker parses with the CLI's own parsers: a guard that they stay argparse parsers."""
    import gateway.cli as cli
    from worker_hooks.sglang.__main__ import build_parser

    assert isinstance(cli.build_parser(), argparse.ArgumentParser)
    assert isinstance(build_parser(), argparse.ArgumentParser)
