"""`lumen cluster kill`, `lumen cluster status` and `lumen cluster config set`: a running gateway's
admin API, from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from gateway.protocol.secrets import SecretError


def admin_key(env: Mapping[str, str], port: int | None = None) -> str | None:
    """The admin key `lumen cluster kill/status` present: the first of LUMEN_ADMIN_API_KEYS (the
    variable the gateway reads its admin keys from), else LUMEN_ADMIN_API_KEY, else the key a gateway
    on `port` generated (`admin-key-<port>` in the per-user runtime directory, mode 0600)."""
    from gateway.protocol.secrets import admin_key_for

    return admin_key_for(port, env)


def _admin(port: int, method: str, path: str) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        key = admin_key(os.environ, port)
    except SecretError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(
            f"lumen: {method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr
        )
        raise SystemExit(1) from exc
    except urllib.error.URLError as exc:
        print(f"lumen: cannot reach the gateway on port {port}: {exc.reason}", file=sys.stderr)
        raise SystemExit(1) from exc


def _call(port: int, method: str, path: str, body: object | None = None) -> tuple[int, Any]:
    """(HTTP status, JSON answer) of one admin request; status 0 when the gateway cannot be reached."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    key = admin_key(os.environ, port)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"error": {"message": raw}}
    except urllib.error.URLError as exc:
        return 0, {"error": {"message": f"cannot reach the gateway on port {port}: {exc.reason}"}}


def cmd_cluster_config_set(args: argparse.Namespace) -> int:
    """`lumen cluster config set KEY=VALUE ... [--port P] [--gateways N]`: one change, applied to every
    gateway of the cluster (ports P .. P+N-1, as `lumen cluster up --gateways N` places them, or each
    `--port` given), each one's new generation or refusal reported; exit 1 when any refused or could
    not be reached."""
    from gateway.config import ConfigError, parse_set

    try:
        changes = parse_set(args.assignments)
    except ConfigError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        return 2
    ports = args.port or [8000]
    if len(ports) == 1:
        ports = list(range(ports[0], ports[0] + args.gateways))
    ok = True
    for port in ports:
        try:
            status, answer = _call(port, "POST", "/admin/config", {"set": changes})
        except SecretError as exc:
            status, answer = 0, {"error": {"message": str(exc)}}
        if status == 200:
            changed = ", ".join(f"{k}: {v['old']} -> {v['new']}" for k, v in answer["changed"].items())
            print(f"gateway :{port}  generation {answer['generation']}  {changed or 'unchanged'}")
        else:
            ok = False
            print(f"gateway :{port}  refused: {answer.get('error', {}).get('message', answer)}")
    return 0 if ok else 1


# what `lumen cluster status` shows of the live configuration (GET /admin/config has every knob)
STATUS_KEYS = ("recovery.theta", "recovery.tau", "load.alpha", "load.beta", "checkpoint.replicas")


def cmd_cluster_kill(args: argparse.Namespace) -> int:
    print(
        json.dumps(
            _admin(
                args.port,
                "POST",
                f"/admin/workers/{args.worker_id}/kill?mode={args.kill_mode}"
                + (f"&factor={args.factor:g}" if args.kill_mode == "slow" else ""),
            )
        )
    )
    return 0


def cmd_cluster_status(args: argparse.Namespace) -> int:
    for w in _admin(args.port, "GET", "/admin/workers"):
        det = w.get("determinism") or {}
        print(
            f"{w['id']:>4} {w['state']:<11} inc={w['incarnation']} running={w['running']} "
            f"waiting={w['waiting']} load={w['load']} replay={det.get('label', '?')}"
        )
        if det and det.get("label") != "exact":  # what a resume on it may not keep, said plainly
            print(f"     {det.get('note', '')}")
    try:  # a gateway without live configuration (an older version) shows none
        status, cfg = _call(args.port, "GET", "/admin/config")
    except SecretError:
        status, cfg = 0, {}
    if status == 200 and isinstance(cfg, dict):
        values = cfg.get("values", {})
        print(
            f"config generation {cfg.get('generation')}: "
            + " ".join(f"{k}={values.get(k)}" for k in STATUS_KEYS)
        )
    return 0
