"""A bounded schemathesis fuzz of the client API against a live gateway with two synthetic workers
(issue 15, item 3): every operation of its own `/openapi.json`, requests that fit the schema and
requests that do not. No response may be a 5xx, every 4xx body must be OpenAI's error shape, and
every response must match what the document says of its status (schemathesis'
`response_schema_conformance`). The counts are printed (`-s` shows them).

schemathesis drives `requests` (blocking), so the gateway and its workers run on their own event loop
in a thread. The default run is bounded (a few hundred requests, well under a minute here); `-m slow`
runs a larger one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

from gateway.config import load_config
from gateway.protocol.launch import EngineSpec
from gateway.server.app import Gateway
from worker_hooks.engine.service import start_worker

KEY = "fuzz-key-000001"
START_WITHIN_S = 60.0  # a hang bound for the cluster's start, not a timing assertion


@contextlib.asynccontextmanager
async def live_cluster(workers: int = 2) -> AsyncIterator[Gateway]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "gateway.api_keys": [KEY],
            "recovery.mode": "stop_restart",
            "limits.max_prompt_tokens": 512,
            "limits.max_new_tokens": 24,
            "limits.default_max_tokens": 8,
            "limits.max_n": 3,
            "health.heartbeat_interval_ms": 50,
            "health.heartbeat_misses": 20,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    ready = asyncio.Event()
    gw.monitor.on_state_change.append(
        lambda _ev: ready.set() if gw.monitor.healthy_count() == workers else None
    )
    try:
        async with contextlib.AsyncExitStack() as stack:
            for i in range(workers):
                spec = EngineSpec(
                    worker_id=f"w{i}",
                    control_address=f"127.0.0.1:{gw.control_port}",
                    control_token=gw.config.gateway.control_token,
                    model="Qwen3-0.6B",
                    time_scale=0.01,
                    heartbeat_interval_ms=50,
                )
                await stack.enter_async_context(start_worker(spec))
            if gw.monitor.healthy_count() < workers:
                await asyncio.wait_for(ready.wait(), START_WITHIN_S)
            yield gw
    finally:
        await gw.stop()


@contextlib.contextmanager
def cluster_in_thread() -> Iterator[str]:
    """The live cluster on an event loop of its own; yields the gateway's base URL."""
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        box["stop"] = (asyncio.get_running_loop(), stop)
        try:
            async with live_cluster() as gw:
                box["url"] = f"http://127.0.0.1:{gw.http_port}"
                started.set()
                await stop.wait()
        except BaseException as exc:
            box["error"] = exc
            raise
        finally:
            started.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="fuzz-cluster", daemon=True)
    thread.start()
    try:
        assert started.wait(START_WITHIN_S), "the cluster did not start"
        if "error" in box:
            raise box["error"]
        yield box["url"]
    finally:
        if "stop" in box:
            loop, stop = box["stop"]
            loop.call_soon_threadsafe(stop.set)
        thread.join(START_WITHIN_S)


@dataclass
class Tally:
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)  # (operation, mode, status)
    failures: list[str] = field(default_factory=list)
    refused_valid: Counter[str] = field(default_factory=Counter)  # schema-valid requests refused, why

    def by_class(self) -> Counter[str]:
        return Counter(f"{status // 100}xx" for (_, _, status), n in self.statuses.items() for _ in range(n))

    def report(self) -> str:
        total = sum(self.statuses.values())
        modes = Counter(mode for (_, mode, _), n in self.statuses.items() for _ in range(n))
        lines = [f"schemathesis: {total} requests, {dict(self.by_class())}, by mode {dict(modes)}"]
        ops = sorted({op for op, _, _ in self.statuses})
        for op in ops:
            per = {f"{m}:{s}": n for (o, m, s), n in sorted(self.statuses.items()) if o == op}
            lines.append(f"  {op}: {per}")
        for why, n in self.refused_valid.most_common():
            lines.append(f"  schema-valid but refused x{n}: {why}")
        return "\n".join(lines)


def openai_error_shape(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str))
    )


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def fuzz(base_url: str, max_examples: int) -> Tally:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    schema.validate()
    tally = Tally()
    session = requests.Session()
    headers = {"Authorization": f"Bearer {KEY}"}

    def checker(label: str, mode: str) -> Any:
        def check(case: Any) -> None:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=30)
            status = response.status_code
            tally.statuses[(label, mode, status)] += 1
            if mode == "positive" and 400 <= status < 500 and openai_error_shape(_json(response)):
                # what the schema cannot say (cross-field rules, a prompt's length once tokenized)
                tally.refused_valid[f"{label}: {_json(response)['error']['message'][:70]}"] += 1
            where = f"{label} [{mode}] -> {status}: {case.as_curl_command(headers=headers)}"
            if 400 <= status < 500:
                body = _json(response)
                if not openai_error_shape(body):
                    tally.failures.append(f"{where}\n    not OpenAI's error shape: {response.text[:300]}")
            try:
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
            except FailureGroup as group:
                tally.failures.extend(f"{where}\n    {str(exc)[:600]}" for exc in group.exceptions)

        return check

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = settings(
                max_examples=max_examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(given(case=op.as_strategy(generation_mode=mode))(checker(op.label, mode.value)))
            try:
                run()
            except Exception as exc:
                # an operation with nothing to make invalid (no body, no parameters) has no negative cases
                if mode is GenerationMode.NEGATIVE and "Unsatisfiable" in type(exc).__name__:
                    continue
                raise
    return tally


def run_fuzz(max_examples: int) -> Tally:
    with cluster_in_thread() as url:
        tally = fuzz(url, max_examples)
    print("\n" + tally.report())
    assert sum(tally.statuses.values()) > 0
    assert not tally.failures, f"{len(tally.failures)} failures:\n" + "\n".join(tally.failures[:10])
    assert not any(status >= 500 for (_, _, status) in tally.statuses)
    return tally


@pytest.mark.timeout(180)
def test_bounded_fuzz_finds_no_5xx_and_only_openai_errors() -> None:
    tally = run_fuzz(max_examples=40)
    ops = {op for op, _, _ in tally.statuses}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /generate"} <= ops
    assert tally.by_class()["2xx"] > 0 and tally.by_class()["4xx"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_larger_fuzz_finds_no_5xx_and_only_openai_errors() -> None:
    run_fuzz(max_examples=300)
