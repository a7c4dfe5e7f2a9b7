"""SGLang's own benchmark client, `python -m sglang.bench_serving` (unmodified, from the lane's sglang
0.5.23), through a Lumen gateway in front of two real SGLang servers started with `--api-key`, on
`/generate` (`--backend sglang`) and `/v1/completions` (`--backend sglang-oai`), and the same run
against a server directly: every request completes both ways (issue 30: through Lumen 0 of 24 did
before, its default streams carried `id:` lines the client's line-by-line parser cannot read).

Offline: `--dataset-name random` samples its prompt ids from a ShareGPT-shaped JSON (`--dataset-path`;
without one it downloads ShareGPT), written here from a few sentences; the tokenizer is the tiny
model's folder. The summaries are printed (docs/results.md has a run's)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.server.app import Gateway
from tests.sglang.real import ServerPool, SGLangServer, tiny_models
from tests.sglang.test_real_agentless import gateway_config

pytestmark = pytest.mark.timeout(900)

PROMPTS = 24
SENTENCES = [
    "The lighthouse keeper watched the sea all night and wrote down every ship that passed.",
    "A small boat carried bread and letters to the island twice a week in summer.",
    "Storms came from the west, and the old stones of the tower held against them.",
    "She counted the waves and the stars and kept the lamp burning until morning.",
]


def sharegpt_file(path: Path) -> Path:
    """A ShareGPT-shaped dataset (human turn, model turn) long enough for the random dataset's prompts."""
    rows = []
    for i in range(32):
        text = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(4))
        rows.append({"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": text}]})
    path.write_text(json.dumps(rows))
    return path


async def bench(base_url: str, backend: str, dataset: Path, out: Path, key: str = "") -> dict[str, Any]:
    """One bench_serving run; its JSON result (`--output-file`), checked to exist."""
    argv = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", base_url,
        "--dataset-name", "random", "--dataset-path", str(dataset), "--tokenizer", str(tiny_models()["target"]),
        "--num-prompts", str(PROMPTS), "--random-input-len", "32", "--random-output-len", "32",
        "--random-range-ratio", "1.0", "--request-rate", "inf", "--max-concurrency", "8",
        "--output-file", str(out), "--seed", "1", "--disable-tqdm",
    ]  # fmt: skip
    env = (
        dict(os.environ, OPENAI_API_KEY=key)
        if key
        else {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    )
    env["HF_HUB_OFFLINE"] = "1"
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), 600)
    text = stdout.decode(errors="replace")
    summary = text[text.find("====") :] if "====" in text else text[-3000:]
    print(f"\n--- bench_serving --backend {backend} at {base_url}\n{summary}")
    assert proc.returncode == 0, text[-4000:]
    lines = [ln for ln in (await asyncio.to_thread(out.read_text)).splitlines() if ln.strip()]
    return dict(json.loads(lines[-1]))


@pytest.fixture
def keyed(real_servers: ServerPool) -> list[SGLangServer]:
    # the lane's key (conftest.py) on the servers' own command line, as a user starts them; the
    # gateway takes it from LUMEN_SGLANG_API_KEY (the environment) for both
    return real_servers.live(2, "--api-key", os.environ["LUMEN_SGLANG_API_KEY"])


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
async def test_bench_serving_completes_through_lumen_and_directly(
    keyed: list[SGLangServer], backend: str, tmp_path: Path
) -> None:
    dataset = sharegpt_file(tmp_path / "sharegpt.json")
    key = os.environ["LUMEN_SGLANG_API_KEY"]
    direct = await bench(keyed[0].url, backend, dataset, tmp_path / "direct.jsonl", key)
    gw = Gateway(gateway_config(keyed))
    await gw.start()
    try:
        async with asyncio.timeout(60):
            while gw.monitor.healthy_count() < len(keyed):
                await asyncio.sleep(0.05)
        lumen = await bench(f"http://127.0.0.1:{gw.http_port}", backend, dataset, tmp_path / "lumen.jsonl")
    finally:
        await gw.stop()
    for name, res in (("direct", direct), ("lumen", lumen)):
        assert res["completed"] == PROMPTS, (name, res.get("completed"))
        assert res["total_output_tokens"] == PROMPTS * 32, (name, res.get("total_output_tokens"))
