"""Assembly of the gateway process: HTTP API, gRPC control plane, monitor, sessions, admin."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aiohttp
import structlog
from aiohttp import web
from grpc import aio

from gateway.config import Config, recovery_policy, server_api_key, sglang_worker_id
from gateway.core.costmodel import CostModel
from gateway.core.dispatch import DispatchParams
from gateway.core.evaluation import holder_balance
from gateway.core.health import WorkerState
from gateway.core.holders import HolderParams
from gateway.core.outage import outage_params
from gateway.core.pairing import PairingParams
from gateway.core.router import routing_params
from gateway.core.types import LoadParams
from gateway.protocol.generate import EngineKind
from gateway.protocol.secrets import worker_http_bearer
from gateway.protocol.sglang import sglang_rid
from gateway.server.admin import AdminAPI, FaultInjector
from gateway.server.api.auth import require_metrics
from gateway.server.api.http_server import ClientRunner
from gateway.server.api.middleware import error_middleware
from gateway.server.api.routes import add_client_routes
from gateway.server.api.tokenizer import make_tokenizer
from gateway.server.checkpoints import CheckpointManager
from gateway.server.control_secret import (
    publish_admin_key,
    publish_token,
    tls_credentials,
    with_admin_key,
    with_control_token,
)
from gateway.server.live_config import LiveConfig, add_config_routes
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.assisted import GatewayVerifier
from gateway.server.recovery.coordinator import RecoveryCoordinator
from gateway.server.recovery.gates import assist_gate, boost_gate
from gateway.server.recovery.levers import OutageLevers
from gateway.server.recovery.pairing import DraftCoordinator
from gateway.server.recovery.rehoming import Rehoming
from gateway.server.recovery.reload import ReloadCoordinator
from gateway.server.request_metrics import request_metrics_middleware
from gateway.server.sessions import SessionManager
from gateway.server.workers.control import ControlService, start_control_server
from gateway.server.workers.fences import FenceLedger
from gateway.server.workers.monitor import LoadMonitor
from gateway.server.workers.server_info import ServerInfoReader
from gateway.server.workers.server_keys import ServerKeys
from gateway.server.workers.sglang import SGLangPoller, SGLangTarget

log = structlog.get_logger("lumen.gateway")


class Gateway:
    def __init__(self, config: Config, *, fault_injector: FaultInjector | None = None) -> None:
        # never an open control plane: no token configured -> one generated (written at start)
        config, self._generated_token = with_control_token(config)
        self._token_file: Path | None = None
        # never an open admin API: no admin key configured -> one generated (written once serving)
        config, self._generated_admin_key = with_admin_key(config)
        self._admin_key_file: Path | None = None
        self.config = config
        self.fault_injector = fault_injector
        self.metrics = GatewayMetrics()
        self.live = LiveConfig(self)  # the knobs changed while serving (live_config.py)
        self.fences = FenceLedger(config.gateway.state_dir) if config.gateway.state_dir else None
        self.monitor = LoadMonitor(
            clock=time.monotonic,
            heartbeat_interval_s=config.health.heartbeat_interval_ms / 1000,
            heartbeat_misses=config.health.heartbeat_misses,
            correlated_grace_s=config.health.correlated_silence_s,
            detector=config.health.detector(),
            record_retention_s=config.health.record_retention_s,
            fences=self.fences,
        )
        self.control = ControlService(
            self.monitor,
            token=config.gateway.control_token,
            heartbeat_interval_ms=config.health.heartbeat_interval_ms,
        )
        self.load_params = LoadParams(
            alpha=config.load.alpha, beta=config.load.beta, nominal_batch=config.engine.max_running_requests
        )
        # restarting SGLang servers reload their weights from a survivor (seeded fast reload)
        self.reload = ReloadCoordinator(
            monitor=self.monitor,
            control=self.control,
            load_params=self.load_params,
            metrics=self.metrics,
            reload=config.engine.reload,  # seeds only with "peer"
            http=lambda: self.http,  # the seed's generation probe
        )
        self.tokenizer = make_tokenizer(config.tokenizer)
        self.policy = recovery_policy(config)
        self.cost = CostModel.preset(config.model.preset, config.model.gpu, config.model.tp or None)
        r = config.recovery
        self.dispatch_params = DispatchParams(
            load=self.load_params,
            rule=self.policy.dispatch,
            theta=r.theta,
            theta_mode=r.theta_mode,
            tau=r.tau,
        )
        self.checkpoints: CheckpointManager | None = None
        self.rehoming: Rehoming | None = None
        if self.policy.checkpointing:
            self.checkpoints = CheckpointManager(
                monitor=self.monitor,
                control=self.control,
                params=HolderParams(
                    load=self.load_params,
                    replicas=config.checkpoint.replicas,
                    exclude_failure_domain=config.checkpoint.exclude_failure_domain,
                    placement=self.policy.placement,
                ),
                kv_bytes_per_token=self.cost.model.kv_bytes_per_token,
                metrics=self.metrics,
            )
            # a dead holder's checkpoints get new holders (the recovery coordinator's re-homing)
            self.rehoming = Rehoming(checkpoints=self.checkpoints, control=self.control, metrics=self.metrics)
        self.assist: DraftCoordinator | None = None
        if self.policy.draft_assist:
            self.assist = DraftCoordinator(
                monitor=self.monitor,
                control=self.control,
                params=PairingParams(
                    load=self.load_params,
                    hysteresis=config.draft.hysteresis,
                    max_drafters_per_target=config.draft.max_drafters_per_target,
                    gate=assist_gate(config, self.cost),
                ),
                k_initial=config.draft.k_initial,
                view=self.checkpoints.view if self.checkpoints is not None else self.monitor.view,
                metrics=self.metrics,
            )
        # the outage levers (recovery/levers.py): Lumen's workers boosted and ordered by leases in
        # Lumen's modes, SGLang servers held at the gateway and ordered by request priorities
        self.levers = OutageLevers(
            monitor=self.monitor,
            control=self.control,
            params=outage_params(r),
            shaping=self.policy.outage_admission,
            clock=time.monotonic,
            heartbeat_interval_s=config.health.heartbeat_interval_ms / 1000,
            gate=boost_gate(config, self.cost),  # the boost where it pays for the load's shape
        )
        self.outage = self.levers.admission
        # the recovery coordinator: the one listener of the workers' state changes, attaches and
        # heartbeats; what a failure sets off, and in what order, is written there
        self.coordinator = RecoveryCoordinator(
            monitor=self.monitor,
            control=self.control,
            metrics=self.metrics,
            reload=self.reload,
            checkpoints=self.checkpoints,
            rehoming=self.rehoming,
            levers=self.levers,
            assist=self.assist,
            base_batch=config.engine.max_running_requests,
        )
        # a restart loading its draft model first goes on only if drafting pays for the full model's
        # later start (the simulator's rule, `Coordinator.assist_wanted`); without draft assist, never
        self.control.draft_first = self.coordinator.draft_first
        self.sglang: SGLangPoller | None = None
        self.server_info: ServerInfoReader | None = None
        # draft assist on SGLang targets: the gateway verifies the drafts itself
        self.verifier: GatewayVerifier | None = None
        if self.assist is not None:
            d = config.draft
            self.verifier = GatewayVerifier(
                drafter_of=self.assist.drafter_of,
                k_min=d.k_min,
                k_max=d.k_max,
                draft_timeout_s=d.draft_timeout_ms / 1000,
                prior=d.agreement,
            )
        self._assist_task: asyncio.Task[None] | None = None
        self._gray_task: asyncio.Task[None] | None = None
        self.sessions: SessionManager | None = None
        self._http: aiohttp.ClientSession | None = None
        self._grpc: aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._detector: asyncio.Task[None] | None = None
        self.http_port = 0
        self.control_port = 0
        self.started_at = time.monotonic()

    @property
    def http(self) -> aiohttp.ClientSession | None:
        """The gateway's client session to workers (None until started)."""
        return self._http

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        g = self.config.gateway
        self._grpc, self.control_port = await start_control_server(
            self.control, g.control_host, g.control_port, tls=tls_credentials(g)
        )
        if self._generated_token:
            self._token_file = publish_token(g, self.control_port)
        self.server_keys = ServerKeys(
            {w.url: server_api_key(w) for w in self.config.sglang.workers}, self.monitor.workers.values
        )
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.timeouts.worker_connect_s),
            # Lumen's workers take requests only with the cluster's bearer (derived from the token)
            headers={"Authorization": f"Bearer {worker_http_bearer(g.control_token)}"},
            # SGLang servers started with --api-key get their own key instead (server_keys.py)
            middlewares=(self.server_keys.middleware,),
        )
        self.sessions = SessionManager(
            monitor=self.monitor,
            http=self._http,
            recovery=self.config.recovery,
            load_params=self.load_params,
            metrics=self.metrics,
            max_concurrent=self.config.limits.max_concurrent_requests,
            policy=self.policy,
            checkpoints=self.checkpoints,
            dispatch_params=self.dispatch_params,
            cost=self.cost,
            route_params=routing_params(self.load_params, self.config.load.route_by_checkpoint_load),
            verifier=self.verifier,
        )
        self.sessions.levers = self.levers
        self.sessions.dispatcher.resume_hooks.append(self.coordinator.begin_recovery)
        # one estimate of the load's shape, fed by the sessions: the draft-assist and boost gates'
        self.levers.set_shape(self.sessions.load_shape)
        if self.assist is not None:
            self.assist.shape = self.sessions.load_shape
        # which SGLang servers order their queue by priority (their /server_info)
        self.server_info = ServerInfoReader(self.monitor, self._http)
        self.coordinator.server_info = self.server_info
        self._detector = asyncio.create_task(self.monitor.run_detector(), name="failure-detector")
        sg = self.config.sglang
        if sg.workers:  # agentless SGLang servers: the gateway attaches and polls them itself
            self.sglang = SGLangPoller(
                self.monitor,
                self._http,
                [
                    SGLangTarget(
                        sglang_worker_id(i, w.id), w.url.rstrip("/"), self.config.model.preset, w.held_batch
                    )
                    for i, w in enumerate(sg.workers)
                ],
                poll_interval_s=sg.poll_interval_ms / 1000,
                misses=self.config.health.heartbeat_misses,
            )
            self.coordinator.follow_polls(self.sglang)  # polls are heartbeats
            self.sglang.start()
        if self.assist is not None:
            # re-pair at a few heartbeat intervals: loads move slowly, pairs should not flap
            period = 5 * self.config.health.heartbeat_interval_ms / 1000
            self._assist_task = asyncio.create_task(self.assist.run(period), name="draft-assist")
        if self.config.gray.enabled:
            gr = self.config.gray
            self.monitor.token_half_life_s, self.monitor.token_min = gr.half_life_s, gr.min_tokens
            self.monitor.measure_tokens = True  # sessions measure each worker's time per token
            self._gray_task = asyncio.create_task(self._watch_gray(), name="gray-failures")
        app = self.build_app()
        # aiohttp's runner with OpenAI error bodies for parser errors and the limits' read deadlines
        self._runner = ClientRunner(
            app,
            self.config,
            access_log=None,
            shutdown_timeout=self.config.timeouts.shutdown_grace_s,
            # a client that goes away cancels its handler, which closes the worker stream (abort)
            handler_cancellation=True,
        )
        await self._runner.setup()
        # reuse_port: several gateway processes accept on one port (the kernel spreads connections)
        site = web.TCPSite(self._runner, g.host, g.port, reuse_port=g.reuse_port or None)
        await site.start()
        self.http_port = int(self._runner.addresses[0][1])
        if self._generated_admin_key:
            self._admin_key_file = publish_admin_key(g.admin_api_keys[0], self.http_port)
        log.info(
            "gateway_started",
            http=f"http://{g.host}:{self.http_port}",
            control=f"{g.control_host}:{self.control_port}",
            mode=self.config.recovery.mode,
        )

    async def _watch_gray(self) -> None:
        """Degrade workers far slower per token than their peers (core/gray.py); with failover on,
        their running requests resume elsewhere, restoring on their holders where they can."""
        gr = self.config.gray
        params = gr.params()
        migrate = gr.migrate and self.policy.failover
        while True:
            await asyncio.sleep(gr.check_interval_s)
            self.monitor.check_gray(params, gr.window_s, gr.probation_s, migrate=migrate)

    async def stop(self) -> None:
        if self.fences is not None:
            self.fences.close()  # our own streams ending from here on fences nobody
        if self._runner is not None:
            await self._runner.cleanup()
        if self.sglang is not None:
            await self.sglang.stop()
        if self.server_info is not None:
            await self.server_info.stop()
        if self.verifier is not None:
            await self.verifier.close()
        await self.reload.close()
        for task in (self._detector, self._assist_task, self._gray_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._grpc is not None:
            await self._grpc.stop(grace=self.config.timeouts.control_stop_grace_s)
        if self._http is not None:
            await self._http.close()
        if self._token_file is not None:
            self._token_file.unlink(missing_ok=True)
            self._token_file = None
        if self._admin_key_file is not None:
            self._admin_key_file.unlink(missing_ok=True)
            self._admin_key_file = None

    def build_app(self) -> web.Application:
        if self.sessions is None:
            raise RuntimeError("Gateway.start() builds the app")
        app = web.Application(
            # outermost: the status each client got, errors included (request_metrics.py)
            middlewares=[request_metrics_middleware(self.metrics), error_middleware],
            client_max_size=self.config.limits.max_request_bytes,
        )
        add_client_routes(
            app,
            config=self.config,
            tokenizer=self.tokenizer,
            generator=self.sessions,
            replay_note=self.sessions.replay_note,
        )
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        AdminAPI(self).add_routes(app)
        add_config_routes(app, self.live)  # GET/POST /admin/config
        return app

    # -- handlers -------------------------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        healthy = self.monitor.healthy_count()
        body = {
            "status": "ok" if healthy else "no_healthy_workers",
            "healthy_workers": healthy,
            "workers": len(self.monitor.workers),
            "mode": self.policy.name,
        }
        return web.json_response(body, status=200 if healthy else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        require_metrics(request, self.config.gateway)  # open unless gateway.metrics_public = false
        for st in WorkerState:
            self.metrics.workers.labels(state=st.value).set(
                sum(1 for w in self.monitor.workers.values() if w.state is st)
            )
        held = []
        for w in self.monitor.workers.values():
            self.metrics.ckpt_tokens_held.labels(worker=w.id).set(w.ckpt_tokens)
            self.metrics.ckpt_bytes_streamed.labels(worker=w.id).set(w.ckpt_bytes_sent_total)
            self.metrics.ckpt_pages_evicted.labels(worker=w.id).set(w.ckpt_pages_evicted_total)
            self.metrics.drafted_tokens.labels(worker=w.id).set(w.drafted_tokens)
            self.metrics.accepted_tokens.labels(worker=w.id).set(w.accepted_tokens)
            self.metrics.draft_rounds.labels(worker=w.id).set(w.draft_rounds)
            if w.held_batch:
                self.metrics.held_waiting.labels(worker=w.id).set(self.levers.held.waiting(w.id))
                self.metrics.held_limit.labels(worker=w.id).set(self.levers.held.limit(w))
            if w.state is WorkerState.HEALTHY:
                held.append(w.ckpt_tokens)
        if self.checkpoints is not None and self.sessions is not None:
            live = [
                self._ckpt_rid(f"{rid}-{s.attempts}", s.worker_id) for rid, s in self.sessions.live.items()
            ]
            cov = self.checkpoints.coverage(live)
            self.metrics.ckpt_coverage.set(cov if cov is not None else 1.0)
            balance = holder_balance(held)
            if balance is not None and balance != float("inf"):
                self.metrics.holder_balance.set(balance)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    def _ckpt_rid(self, wrid: str, worker_id: str | None) -> str:
        """The rid an attempt's checkpoint is booked under: an SGLang server's pages are filed under
        `sglang_rid` (sessions.py `_attempt`)."""
        w = self.monitor.workers.get(worker_id) if worker_id is not None else None
        return sglang_rid(wrid) if w is not None and w.engine is EngineKind.SGLANG else wrid
