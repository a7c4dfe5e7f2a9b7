"""`lumen cluster kill` and `lumen cluster status`: a running gateway's admin API, from the command line."""

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
    return 0
