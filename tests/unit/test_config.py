"""Config: the default file equals the schema defaults; bad values name the key, value and reason."""

from pathlib import Path

import pytest

from gateway.config import Config, ConfigError, load_config


def test_default_file_matches_schema_defaults() -> None:
    assert load_config() == Config()


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("recovery.theta", -1, "must be a finite number >= 0"),
        ("recovery.outage_boost_min_gain", -0.5, "must be a finite number >= 0"),
        ("recovery.mode", "magic", "must be one of"),
        ("recovery.tau", "512", "must be an integer"),
        ("health.heartbeat_interval_ms", 0, "must be in 1..10000"),
        ("checkpoint.replicas", 3, "must be 1 or 2"),
        ("checkpoint.eviction", "fifo", "must be one of"),
        ("engine.page_size", 48, "power of two"),
        ("gateway.port", 70000, "TCP port"),
        ("model.preset", "GPT-9", "unknown preset"),
        ("limits.default_max_tokens", 100000, "must be in 1..limits.max_new_tokens"),
        ("limits.max_n", 0, "must be in 1..128"),
        ("limits.max_n", 129, "must be in 1..128"),
        ("draft.k_initial", 99, "k_min..k_max"),
        ("engine.time_scale", True, "must be a number"),
        ("recovery.bogus", 1, "unknown key"),
        ("engine.backend", "tensorrt", "must be one of"),
        ("torch.model", "qwen9-1t", "neither a preset"),
        ("torch.draft", "self:0", "N >= 1"),
        ("torch.dtype", "int4", "must be one of"),
        ("torch.device", "tpu", "cpu, cuda or cuda:N"),
    ],
)
def test_invalid_values_name_key_value_and_reason(key: str, value: object, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: value})
    msg = str(info.value)
    assert f"'{key}'" in msg and why in msg and repr(value).strip("'") in msg


def test_unknown_section_and_bad_toml(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text("[nonsense]\nx = 1\n")
    with pytest.raises(ConfigError, match="'nonsense'"):
        load_config(bad)
    bad.write_text("[recovery\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_draft_pairs_are_validated(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[draft.pairs]]\ntarget = "Qwen3-32B"\ndraft = "Nope-1B"\n')
    with pytest.raises(ConfigError, match=r"draft.pairs\[0\].draft"):
        load_config(f)


def test_env_supplies_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUMEN_API_KEYS", "key-aaaaaaaa, key-bbbbbbbb")
    monkeypatch.setenv("LUMEN_CONTROL_TOKEN", "s3cret-s3cret-s3cret")
    monkeypatch.setenv("LUMEN_CONTROL_TOKEN_FILE", "/run/lumen/token")
    cfg = load_config()
    assert cfg.gateway.api_keys == ("key-aaaaaaaa", "key-bbbbbbbb")
    assert cfg.gateway.control_token == "s3cret-s3cret-s3cret"
    assert cfg.gateway.control_token_file == "/run/lumen/token"


def test_a_short_control_token_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUMEN_CONTROL_TOKEN", "s3cret")
    with pytest.raises(ConfigError, match=r"gateway.control_token.*16 characters"):
        load_config()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "gateway.internal"])
def test_a_control_plane_beyond_loopback_needs_tls_or_an_explicit_insecure(host: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"gateway.control_host.*TLS"):
        load_config(overrides={"gateway.control_host": host})
    assert load_config(overrides={"gateway.control_host": host, "gateway.control_insecure": True})
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    tls = {"gateway.control_tls_cert": str(cert), "gateway.control_tls_key": str(key)}
    assert load_config(overrides={"gateway.control_host": host, **tls})
    with pytest.raises(ConfigError, match=r"gateway.control_tls_key"):
        load_config(overrides={"gateway.control_host": host, "gateway.control_tls_cert": str(cert)})
    with pytest.raises(ConfigError, match=r"gateway.control_tls_cert.*not found"):
        load_config(overrides={**tls, "gateway.control_tls_cert": str(tmp_path / "missing.pem")})


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.3.2.1"])
def test_a_loopback_control_plane_needs_no_tls(host: str) -> None:
    assert load_config(overrides={"gateway.control_host": host}).gateway.control_host == host


def test_incompatible_draft_pair_is_refused_with_the_reason(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[draft.pairs]]\ntarget = "Qwen3-32B"\ndraft = "Llama-3.2-1B"\n')
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert "draft.pairs[0]" in str(info.value) and "vocabulary" in str(info.value)


def test_policy_defaults_and_bounds_have_one_home() -> None:
    """The gateway's config and the simulator's scenarios take θ, τ, α, β, replicas, pairing and
    gray-failure defaults from the core parameters, and refuse exactly what those refuse."""
    from gateway.core.dispatch import DispatchParams
    from gateway.core.gray import GrayParams
    from gateway.core.holders import HolderParams
    from gateway.core.pairing import PairingParams
    from gateway.core.types import LoadParams
    from gateway.protocol.kv import DEFAULT_PAGE_SIZE
    from gateway.protocol.launch import EngineSpec
    from gateway.sim.scenario import Scenario, ScenarioError, parse_scenario

    cfg, sc = Config(), Scenario()
    d, h, p, g, lp = DispatchParams(), HolderParams(), PairingParams(), GrayParams(), LoadParams()
    for ours in (cfg.recovery, sc.recovery):
        assert (ours.theta, ours.theta_mode, ours.tau) == (d.theta, d.theta_mode, d.tau)
    assert (cfg.load.alpha, cfg.load.beta) == (sc.recovery.alpha, sc.recovery.beta) == (lp.alpha, lp.beta)
    assert cfg.checkpoint.replicas == sc.recovery.replicas == h.replicas
    assert cfg.recovery.placement == h.placement
    assert (cfg.draft.hysteresis, sc.draft.hysteresis) == (p.hysteresis, p.hysteresis)
    assert (cfg.gray.slow_factor, sc.gray.slow_factor) == (g.slow_factor, g.slow_factor)
    page_sizes = {
        cfg.engine.page_size,
        sc.cluster.page_size,
        EngineSpec(worker_id="w", control_address="").page_size,
    }
    assert page_sizes == {DEFAULT_PAGE_SIZE}
    for theta, ok in ((0.0, True), (0.5, True), (-1.0, False), (float("inf"), False)):
        try:
            DispatchParams(theta=theta)
            core_ok = True
        except ValueError:
            core_ok = False
        try:
            load_config(overrides={"recovery.theta": theta})
            config_ok = True
        except ConfigError:
            config_ok = False
        try:
            parse_scenario({"workload": {"rate": 1.0}, "recovery": {"theta": theta}})
            sim_ok = True
        except ScenarioError:
            sim_ok = False
        assert core_ok == config_ok == sim_ok == ok, theta


def test_cluster_commands_read_the_admin_keys_the_gateway_reads() -> None:
    from gateway.cli.admin import admin_key

    assert admin_key({"LUMEN_ADMIN_API_KEYS": " first-key-1234 , second-key-5678"}) == "first-key-1234"
    assert admin_key({"LUMEN_ADMIN_API_KEY": "legacy-key-1234"}) == "legacy-key-1234"
    assert admin_key({}) is None


def test_the_shipped_default_toml_says_what_the_sections_default_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package has no configs/ folder and falls back to the sections' defaults: both
    must be the same configuration."""
    from gateway.config import loader

    shipped = load_config()
    monkeypatch.setattr(loader, "DEFAULT_CONFIG_PATH", loader.DEFAULT_CONFIG_PATH.with_name("absent.toml"))
    assert load_config() == shipped
