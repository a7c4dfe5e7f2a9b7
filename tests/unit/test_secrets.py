"""The cluster secret's conventions (gateway/protocol/secrets.py) and the gateway's provisioning of it
(gateway/server/control_secret.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import load_config
from gateway.protocol.secrets import (
    SecretError,
    bearer_matches,
    default_token_path,
    generate_token,
    read_token_file,
    resolve_token,
    worker_http_bearer,
    write_token_file,
)
from gateway.server.control_secret import publish_token, with_control_token


def test_generated_tokens_are_long_and_distinct() -> None:
    tokens = {generate_token() for _ in range(100)}
    assert len(tokens) == 100 and all(len(t) >= 40 for t in tokens)


@given(st.text(min_size=1, max_size=64), st.text(min_size=1, max_size=64))
def test_the_worker_bearer_is_a_keyed_digest_not_the_token(a: str, b: str) -> None:
    assert worker_http_bearer(a) != a and len(worker_http_bearer(a)) == 64
    assert (worker_http_bearer(a) == worker_http_bearer(b)) == (a == b)
    assert bearer_matches(f"Bearer {worker_http_bearer(a)}", worker_http_bearer(a))
    assert not bearer_matches(worker_http_bearer(a), worker_http_bearer(a))  # no scheme
    assert not bearer_matches(None, worker_http_bearer(a))
    assert worker_http_bearer("") == ""


def test_a_token_file_is_owner_only_and_refused_when_others_can_read_it(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "token"
    write_token_file(path, "t" * 43)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_token_file(path) == "t" * 43
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="other users"):
        read_token_file(path)
    os.chmod(path, 0o600)
    path.write_text("  \n")
    with pytest.raises(SecretError, match="empty"):
        read_token_file(path)
    with pytest.raises(SecretError, match="missing"):
        read_token_file(tmp_path / "missing")


def test_a_worker_finds_its_token_env_first_then_file_then_the_ports_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert resolve_token({}, 4242) == ""
    write_token_file(default_token_path(4242), "from-default-file")
    assert resolve_token({}, 4242) == "from-default-file"
    named = tmp_path / "named"
    write_token_file(named, "from-named-file")
    assert resolve_token({"LUMEN_CONTROL_TOKEN_FILE": str(named)}, 4242) == "from-named-file"
    env = {"LUMEN_CONTROL_TOKEN": "from-env", "LUMEN_CONTROL_TOKEN_FILE": str(named)}
    assert resolve_token(env, 4242) == "from-env"


def test_the_gateway_always_has_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LUMEN_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("LUMEN_CONTROL_TOKEN_FILE", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    cfg, generated = with_control_token(load_config())
    assert generated and len(cfg.gateway.control_token) >= 40
    path = publish_token(cfg.gateway, 5555)
    assert path == default_token_path(5555) and read_token_file(path) == cfg.gateway.control_token
    # a configured token is kept; a configured file that exists is read, not overwritten
    given_cfg = load_config(overrides={"gateway.control_token": "configured-token-123"})
    assert with_control_token(given_cfg) == (given_cfg, False)
    from_file, generated = with_control_token(
        load_config(overrides={"gateway.control_token_file": str(path)})
    )
    assert not generated and from_file.gateway.control_token == cfg.gateway.control_token


def test_a_token_file_must_be_ours_and_not_a_link(tmp_path: Path) -> None:
    """Issue 29: owner and mode come from the open file (fstat), the path is opened with O_NOFOLLOW."""
    real = tmp_path / "real"
    write_token_file(real, "r" * 43)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(SecretError, match="symbolic link"):
        read_token_file(link)
    if os.geteuid() == 0:  # another uid's 0600 file is refused, not only a readable one
        os.chown(real, 65534, 65534)
        with pytest.raises(SecretError, match="owned by uid 65534"):
            read_token_file(real)


def test_writing_a_token_never_writes_through_a_planted_file(tmp_path: Path) -> None:
    """The temporary file has a random name and is created with O_EXCL|O_NOFOLLOW; a link planted at
    the target itself is replaced by the rename, its target untouched."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "token"
    target.symlink_to(victim)
    write_token_file(target, "t" * 43)
    assert victim.read_text() == "keep me" and not target.is_symlink()
    assert read_token_file(target) == "t" * 43
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token", "victim"]  # no temporary left


def test_the_admin_key_is_found_in_the_environment_then_the_ports_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.protocol.secrets import admin_headers, admin_key_for, default_admin_key_path, private_dir

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert admin_key_for(8123, {}) is None and admin_headers("http://127.0.0.1:8123", {}) == {}
    write_token_file(default_admin_key_path(8123), "a" * 43)
    assert stat.S_IMODE(default_admin_key_path(8123).parent.stat().st_mode) == 0o700
    assert admin_headers("http://127.0.0.1:8123/admin/workers", {}) == {"Authorization": "Bearer " + "a" * 43}
    assert admin_key_for(8123, {"LUMEN_ADMIN_API_KEYS": " k1 ,k2"}) == "k1"
    # a runtime directory that is not a directory of ours is refused
    bad = tmp_path / "file"
    bad.write_text("")
    with pytest.raises(SecretError, match=r"exists|not a directory"):
        private_dir(bad)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(SecretError, match="not a directory"):  # a link to a directory is refused too
        private_dir(link)
