"""Loading the config: the TOML file (default configs/default.toml), `--set` overrides, secrets from the
environment, then validation. Every failure is a ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any, NoReturn

from gateway.config.convert import build, to_dict
from gateway.config.errors import ConfigError
from gateway.config.sections import Config
from gateway.config.validate import validate

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "default.toml"


def _fail(key: str, value: object, why: str) -> NoReturn:
    raise ConfigError(key, value, why)


def from_dict(raw: dict[str, Any]) -> Config:
    """A validated Config from TOML-shaped tables (secrets from the environment applied)."""
    cfg: Config = build(Config, raw, "", _fail)
    cfg = apply_env(cfg)
    validate(cfg)
    return cfg


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """`cfg` with dotted-key overrides (`{"recovery.mode": "none"}`) applied, validated."""
    raw = to_dict(cfg)
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if section not in raw or not key:
            raise ConfigError(dotted, value, "unknown key")
        raw[section][key] = value
    return from_dict(raw)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load `path` (default: configs/default.toml), apply overrides and environment, validate."""
    p = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        # an installed package has no configs/ folder: the sections' own defaults are the defaults
        text = "" if path is None and not p.exists() else p.read_text()
    except OSError as exc:
        raise ConfigError("--config", str(p), f"cannot read: {exc.strerror}") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", str(p), f"not valid TOML: {exc}") from exc
    cfg = from_dict(raw)
    return with_overrides(cfg, overrides) if overrides else cfg


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items as overrides; VALUE is read as TOML (a bare word is a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, raw, "--set expects KEY=VALUE")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw
    return out


def apply_env(cfg: Config) -> Config:
    """Secrets from the environment: LUMEN_API_KEYS, LUMEN_ADMIN_API_KEYS (comma-separated),
    LUMEN_CONTROL_TOKEN, LUMEN_CONTROL_TOKEN_FILE; each replaces its config key when set.
    LUMEN_SGLANG_API_KEY (or LUMEN_SGLANG_API_KEY_FILE): the key of every SGLang server whose
    `[[sglang.workers]]` entry names none."""
    g = cfg.gateway
    env = os.environ

    def keys(name: str, current: tuple[str, ...]) -> tuple[str, ...]:
        v = env.get(name)
        return tuple(k.strip() for k in v.split(",") if k.strip()) if v else current

    g = dataclasses.replace(
        g,
        api_keys=keys("LUMEN_API_KEYS", g.api_keys),
        admin_api_keys=keys("LUMEN_ADMIN_API_KEYS", g.admin_api_keys),
        control_token=env.get("LUMEN_CONTROL_TOKEN", g.control_token),
        control_token_file=env.get("LUMEN_CONTROL_TOKEN_FILE", g.control_token_file),
    )
    # an SGLang server's key: its own entry's, else the environment's for every server naming none
    sk, skf = env.get("LUMEN_SGLANG_API_KEY", ""), env.get("LUMEN_SGLANG_API_KEY_FILE", "")
    workers = tuple(
        w
        if w.api_key or w.api_key_file or not (sk or skf)
        else dataclasses.replace(w, api_key=sk, api_key_file=skf if not sk else "")
        for w in cfg.sglang.workers
    )
    return dataclasses.replace(cfg, gateway=g, sglang=dataclasses.replace(cfg.sglang, workers=workers))
