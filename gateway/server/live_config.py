"""Policy knobs changed while serving (issue 30): `POST /admin/config`, `GET /admin/config`, SIGHUP.

The knobs in `LIVE` are safe to change on a serving gateway: θ, τ and θ's mode, α and β, checkpoint
replicas, the draft-assist gate, the outage levers, the failure detector's sensitivity and the request
limits. A change is the config with the new values, validated as at start-up (`with_overrides`: the
same ConfigError messages, naming the key) and refused whole on any error, or when it names a knob
that cannot change while serving (ports, planes, keys, modes, ...: `not_live_reason`). Once valid it
is installed in one step, between two decisions (the event loop runs nothing else meanwhile): each
decider's parameter object is replaced by one built from the new config, the same way the gateway
built it at start (app.py), so every decision after the change reads the new values and none reads
a mix. Streams in flight are not touched. Each applied change raises the config `generation`, is kept
(`changes`: time, source, old and new values), logged (`config_changed`), and shown in /metrics
(`lumen_config_generation`, `lumen_config_value{key}`) and in `lumen cluster status`.

SIGHUP re-reads the config file the gateway started from (with its command line's `--set` on top,
as at start): the live knobs whose values differ are applied as one change; a file that changes a
knob that is not live is refused whole (logged, naming the keys), as is a file that does not load.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from prometheus_client import Gauge

from gateway.config import Config, ConfigError, with_overrides
from gateway.config.convert import to_dict
from gateway.core.outage import outage_params
from gateway.core.router import routing_params
from gateway.server.api.auth import require_admin
from gateway.server.api.errors import InvalidRequest
from gateway.server.api.ratelimit import Limits
from gateway.server.api.routes import CLIENT_API
from gateway.server.api.schemas import bounds_of
from gateway.server.recovery.gates import assist_gate, boost_gate

if TYPE_CHECKING:
    from gateway.server.app import Gateway

log = structlog.get_logger("lumen.config")

# the knobs a serving gateway takes, by what they configure
LIVE: dict[str, str] = {
    "recovery.theta": "dispatch",
    "recovery.tau": "dispatch",
    "recovery.theta_mode": "dispatch",
    "load.alpha": "load",
    "load.beta": "load",
    "load.route_by_checkpoint_load": "load",
    "checkpoint.replicas": "holders",
    "draft.assist_gate": "draft",
    "draft.assist_min_gain": "draft",
    "draft.assist_min_waiting": "draft",
    "draft.hysteresis": "draft",
    "recovery.resumed_first": "outage",
    "recovery.outage_batch_boost": "outage",
    "recovery.outage_shortest_first": "outage",
    "recovery.outage_shortest_first_rate": "outage",
    "recovery.outage_boost_min_gain": "outage",
    "health.phi_suspect": "detector",
    "health.phi_fail": "detector",
    "health.pause_factor": "detector",
    "health.pause_half_life_s": "detector",
    "health.min_std_ratio": "detector",
    "health.max_silence_ms": "detector",
    "limits.max_prompt_tokens": "limits",
    "limits.max_new_tokens": "limits",
    "limits.default_max_tokens": "limits",
    "limits.max_n": "limits",
    "limits.max_concurrent_requests": "limits",
    "limits.sse_keepalive_s": "limits",
    "limits.body_timeout_s": "limits",
    "limits.per_key_max_concurrent": "limits",
    "limits.per_key_rate_per_s": "limits",
    "limits.per_key_burst": "limits",
}

_NOT_LIVE: dict[str, str] = {
    "gateway": "ports, addresses, planes and keys are the process's own",
    "engine": "the workers are launched with it",
    "torch": "the workers are launched with it",
    "model": "the cost model is built once",
    "tokenizer": "the tokenizer is loaded once",
    "cluster": "the supervisor reads it at start",
    "sglang": "the servers are attached at start",
    "timeouts": "the connections are built with it",
    "gray": "the gray-failure watch is built once",
}


def not_live_reason(key: str) -> str:
    section = key.partition(".")[0]
    why = _NOT_LIVE.get(section, "it is read once, at start")
    return f"cannot change while serving ({why}); restart the gateway with the new value"


def value_of(cfg: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return to_dict(getattr(getattr(cfg, section), name))


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """One applied change: when (unix time), its generation, who asked, and each key's old and new value."""

    t: float
    generation: int
    source: str
    changes: dict[str, dict[str, Any]]

    def as_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 3),
            "generation": self.generation,
            "source": self.source,
            "changes": self.changes,
        }


class LiveConfig:
    """The gateway's live knobs: `set` (POST /admin/config), `reload` (SIGHUP), `values`, `generation`."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.generation = 1
        self.changes: list[ConfigChange] = []
        self.app: web.Application | None = None  # the HTTP app (its client API's bounds are live)
        self._loader: Callable[[], Config] | None = None
        self._base: dict[str, Any] | None = None  # what the loader gave at start, as TOML tables
        r = gw.metrics.registry
        self._g_generation = Gauge(
            "lumen_config_generation", "Generation of the live configuration (1 at start)", registry=r
        )
        self._g_value = Gauge(
            "lumen_config_value", "Live configuration values (numbers and switches)", ["key"], registry=r
        )
        self._publish()

    # -- reading ----------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        return {k: value_of(self.gw.config, k) for k in LIVE}

    def as_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "values": self.values(),
            "changes": [c.as_json() for c in self.changes[-20:]],
            "sighup": self._loader is not None,
        }

    # -- changing ---------------------------------------------------------------------------------
    def set(self, changes: Mapping[str, Any], source: str = "admin") -> ConfigChange | None:
        """Apply `changes` (dotted keys as in configs/default.toml) whole, or raise ConfigError naming the
        first key refused. None when nothing differs (the generation stays)."""
        for key, value in changes.items():
            if key not in LIVE:
                if "." not in key or not hasattr(self.gw.config, key.partition(".")[0]):
                    raise ConfigError(key, value, "unknown key")
                raise ConfigError(key, value, not_live_reason(key))
        old = self.gw.config
        new = with_overrides(old, dict(changes))  # validated: the messages of a start-up
        diff = {
            k: {"old": value_of(old, k), "new": value_of(new, k)}
            for k in changes
            if value_of(old, k) != value_of(new, k)
        }
        if not diff:
            return None
        self._check_installable(new)
        self._install(new)
        self.generation += 1
        change = ConfigChange(time.time(), self.generation, source, diff)
        self.changes.append(change)
        del self.changes[:-100]
        self._publish()
        log.info("config_changed", generation=self.generation, source=source, changes=diff)
        return change

    def watch_sighup(self, loader: Callable[[], Config]) -> None:
        """Re-read the config (`loader`: the file and --set the gateway started from) on SIGHUP."""
        self._loader = loader
        self._base = to_dict(loader())
        import asyncio

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self) -> None:
        try:
            change = self.reload()
        except ConfigError as exc:
            log.error("config_reload_refused", key=exc.key, error=str(exc), generation=self.generation)
            return
        log.info("config_reloaded", generation=self.generation, changed=bool(change))

    def reload(self) -> ConfigChange | None:
        """SIGHUP: the file re-read; its live knobs applied as one change, refused whole (ConfigError)
        when it does not load or changes a knob that is not live."""
        if self._loader is None or self._base is None:
            raise ConfigError("config", None, "this gateway was not started from a config file")
        fresh = self._loader()
        raw = to_dict(fresh)
        for section, table in raw.items():
            for name, value in table.items():
                key = f"{section}.{name}"
                if key not in LIVE and value != self._base[section][name]:
                    raise ConfigError(key, value, not_live_reason(key))
        wanted = {k: value_of(fresh, k) for k in LIVE if value_of(fresh, k) != value_of(self.gw.config, k)}
        return self.set(wanted, source="sighup") if wanted else None

    # -- installing -------------------------------------------------------------------------------
    def _check_installable(self, new: Config) -> None:
        """What the config allows but a serving gateway cannot take: the outage admission and the
        per-key limiter, built at start only when they were on, cannot be turned on."""
        gw = self.gw
        lim = new.limits
        if self.app is not None and self.app[CLIENT_API].limiter is None:
            for key, value in (
                ("limits.per_key_max_concurrent", lim.per_key_max_concurrent),
                ("limits.per_key_rate_per_s", lim.per_key_rate_per_s),
            ):
                if value:
                    raise ConfigError(
                        key, value, "per-key limits were off at start: turning them on needs a restart"
                    )
        if gw.levers.admission is None and gw.policy.outage_admission:
            r = new.recovery
            if r.outage_batch_boost > 1 or r.outage_shortest_first:
                key = (
                    "recovery.outage_batch_boost"
                    if r.outage_batch_boost > 1
                    else "recovery.outage_shortest_first"
                )
                raise ConfigError(
                    key,
                    value_of(new, key),
                    "the outage levers were off at start: turning them on needs a restart",
                )

    def _install(self, new: Config) -> None:
        """Every decider's parameters rebuilt from `new` as app.py builds them, and swapped in."""
        gw = self.gw
        r, ld = new.recovery, new.load
        load = dataclasses.replace(gw.load_params, alpha=ld.alpha, beta=ld.beta)
        dispatch = dataclasses.replace(
            gw.dispatch_params, load=load, theta=r.theta, theta_mode=r.theta_mode, tau=r.tau
        )
        route = routing_params(load, ld.route_by_checkpoint_load)
        gw.load_params, gw.dispatch_params = load, dispatch
        s = gw.sessions
        if s is not None:
            s.load_params, s.dispatch_params, s.route_params = load, dispatch, route
            s.dispatcher.dispatch_params, s.dispatcher.route_params = dispatch, route
            s.max_concurrent = new.limits.max_concurrent_requests
        gw.reload.load_params = load
        if gw.checkpoints is not None:
            gw.checkpoints.params = dataclasses.replace(
                gw.checkpoints.params, load=load, replicas=new.checkpoint.replicas
            )
        if gw.assist is not None:
            gw.assist.params = dataclasses.replace(
                gw.assist.params, load=load, hysteresis=new.draft.hysteresis, gate=assist_gate(new, gw.cost)
            )
        outage = outage_params(r)
        gw.levers.params = outage
        if gw.levers.admission is not None:
            gw.levers.admission.params = outage
            gw.levers.admission.gate = boost_gate(new, gw.cost)
        detection = gw.monitor.detection
        detection.params = new.health.detector()
        for rec in gw.monitor.workers.values():
            if rec.detector is not None:
                rec.detector.retune(detection.params.for_interval(rec.detector.params.interval_s))
        if self.app is not None:
            api = self.app[CLIENT_API]
            api.config = new
            api.bounds = bounds_of(new, api.tokenizer.vocab_size)
            api.openapi.clear()  # /openapi.json is built again from the new bounds
            if api.limiter is not None:  # read on every admission
                lim = new.limits
                api.limiter.limits = Limits(
                    lim.per_key_max_concurrent, lim.per_key_rate_per_s, lim.per_key_burst
                )
        gw.config = new

    def _publish(self) -> None:
        self._g_generation.set(self.generation)
        for k, v in self.values().items():
            if isinstance(v, bool | int | float):
                self._g_value.labels(key=k).set(float(v))


def add_config_routes(app: web.Application, live: LiveConfig) -> None:
    live.app = app

    async def get_config(request: web.Request) -> web.Response:
        require_admin(request, live.gw.config.gateway.admin_api_keys)
        return web.json_response(live.as_json())

    async def post_config(request: web.Request) -> web.Response:
        """`{"set": {"recovery.theta": 3.0, ...}}`: applied whole or refused whole (400 naming the key)."""
        require_admin(request, live.gw.config.gateway.admin_api_keys)
        try:
            body = await request.json()
        except ValueError as exc:
            raise InvalidRequest('the body must be JSON: {"set": {"section.key": value, ...}}') from exc
        changes = body.get("set") if isinstance(body, dict) else None
        if not isinstance(changes, dict) or not changes:
            raise InvalidRequest(
                'the body must be {"set": {"section.key": value, ...}} with at least one key', param="set"
            )
        try:
            change = live.set(changes)
        except ConfigError as exc:
            code = "not_live" if "cannot change while serving" in exc.why else "invalid_config"
            raise InvalidRequest(str(exc), param=exc.key, code=code) from exc
        return web.json_response(
            {"generation": live.generation, "changed": change.changes if change is not None else {}}
        )

    app.router.add_get("/admin/config", get_config)
    app.router.add_post("/admin/config", post_config)
