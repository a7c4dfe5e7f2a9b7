"""Measure the torch engine's costs on a GPU: the constants the cost model (gateway/core/costmodel.py) needs.

Random weights of the real shapes (`--target qwen3-8b --draft qwen3-0.6b`, presets of
models/torch_config.py), so nothing is downloaded. Every timing is the median of
`--repeats` runs after `--warmup` runs, with torch.cuda.synchronize() before and after each run.

  a) restore vs recompute per context: restore = import_pages of the context's pages from a pinned
     host buffer (host -> device); recompute = prefill of the same tokens in chunks of --chunk;
  b) decode step time vs batch size at --decode-context (target and draft). The KV cache holds random
     values: a step's time does not depend on them, and filling 256 x 1K contexts by prefill would
     dominate the run;
  c) verification: one step of --verify-batch requests with k drafts each (k+1 tokens, all logits);
  d) weight load time from local safetensors (written by save_model first): "cold" after asking the
     kernel to drop the files from its page cache (posix_fadvise DONTNEED after fsync, best effort,
     no root needed), then "warm" with the files cached;
  e) derived constants: KV bytes/token, prefill tokens/s, decode ms per step and per batch element
     (least squares over the batch sizes), H2D GB/s for restore, load GB/s.

The KV cache is allocated per measurement, only as large as that measurement needs (qwen3-8b bf16:
16.4 GB weights, 4.8 GB KV at 32K, 41 GB KV for 256 x 1K decode). `--quick` shrinks everything to
tiny presets so it runs on a CPU in seconds:

    .venv/bin/python scripts/bench_torch.py --device cpu --quick --out /tmp/bench_torch_smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.torch_config import ModelConfig, parse_dtype, resolve_config
from models.torch_kv_cache import PagedKVCache
from models.torch_model import BatchItem, CausalLM
from models.torch_weights import load_model, load_or_init, save_model

FULL = {
    "target": "qwen3-8b",
    "draft": "qwen3-0.6b",
    "contexts": [1024, 4096, 16384, 32768],
    "batches": [1, 8, 32, 64, 128, 256],
    "ks": [0, 1, 2, 4, 8],
    "decode_context": 1024,
    "verify_batch": 32,
    "chunk": 8192,
    "page_size": 64,
    "repeats": 5,
    "warmup": 2,
}
QUICK = {
    "target": "tiny",
    "draft": "tiny-draft",
    "contexts": [64, 256],
    "batches": [1, 4, 8],
    "ks": [0, 1, 2],
    "decode_context": 64,
    "verify_batch": 4,
    "chunk": 128,
    "page_size": 16,
    "repeats": 3,
    "warmup": 1,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = parse_dtype(args.dtype)
        self.rng = np.random.default_rng(args.seed)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        """Median wall time of fn in ms, after warm-up runs, synchronised around every run."""
        for _ in range(self.args.warmup):
            fn()
        times = []
        for _ in range(repeats or self.args.repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def tokens(self, cfg: ModelConfig, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, cfg.vocab_size, n)]

    def random_cache(self, cfg: ModelConfig, pages: int) -> PagedKVCache:
        cache = PagedKVCache(cfg, pages, self.args.page_size, dtype=self.dtype, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed)
        for t in (*cache.k, *cache.v):
            t.normal_(generator=gen)
        return cache

    # -- a) restore vs recompute -----------------------------------------------------------------
    def restore_vs_recompute(self, model: CausalLM) -> list[dict[str, Any]]:
        ps, chunk, cfg = self.args.page_size, self.args.chunk, model.cfg
        npages = -(-max(self.args.contexts) // ps)
        cache = PagedKVCache(cfg, npages, ps, dtype=self.dtype, device=self.device)
        table = list(range(npages))
        rows = []
        for n in self.args.contexts:
            toks, pages = self.tokens(cfg, n), table[: -(-n // ps)]

            def recompute(toks: list[int] = toks, n: int = n) -> None:
                for s in range(0, n, chunk):
                    part = toks[s : s + chunk]
                    last = s + chunk >= n
                    model.forward_batch([BatchItem(table, s, part, -1 if last else len(part))], cache)

            recompute_ms = self.time_ms(recompute, repeats=min(self.args.repeats, 3))
            host = cache.export_pages(pages)  # pinned on CUDA: the restore source

            def restore(pages: list[int] = pages, host: np.ndarray = host) -> None:
                cache.import_pages(pages, host)

            restore_ms = self.time_ms(restore)
            row = {
                "context": n,
                "pages": len(pages),
                "bytes": int(host.nbytes),
                "recompute_ms": recompute_ms,
                "restore_ms": restore_ms,
                "ratio": recompute_ms / restore_ms,
                "prefill_tok_s": n / recompute_ms * 1e3,
                "h2d_gb_s": host.nbytes / restore_ms / 1e6,
            }
            rows.append(row)
            log(
                f"context {n}: recompute {recompute_ms:.1f} ms, restore {restore_ms:.2f} ms (x{row['ratio']:.1f})"
            )
            del host
        return rows

    # -- b) decode, c) verify ----------------------------------------------------------------------
    def decode_and_verify(
        self, model: CausalLM, batches: list[int], verify: bool
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        ps, ctx, cfg = self.args.page_size, self.args.decode_context, model.cfg
        most = max(batches + ([self.args.verify_batch] if verify else []))
        per_item = -(-(ctx + max(self.args.ks) + 1) // ps)
        cache = self.random_cache(cfg, most * per_item)
        tables = [list(range(i * per_item, (i + 1) * per_item)) for i in range(most)]
        toks = self.tokens(cfg, most * (max(self.args.ks) + 1))

        def step(items: list[BatchItem]) -> Callable[[], object]:
            return lambda: model.forward_batch(items, cache)

        decode = []
        for b in batches:
            ms = self.time_ms(step([BatchItem(tables[i], ctx, toks[i : i + 1]) for i in range(b)]))
            decode.append(
                {"batch": b, "context": ctx, "step_ms": ms, "ms_per_seq": ms / b, "tok_s": b / ms * 1e3}
            )
            log(f"decode batch {b} @ {ctx}: {ms:.2f} ms/step")
        rows: list[dict[str, Any]] = []
        for k in self.args.ks if verify else []:
            vb = self.args.verify_batch
            items = [BatchItem(tables[i], ctx, toks[i * (k + 1) : (i + 1) * (k + 1)], 0) for i in range(vb)]
            ms = self.time_ms(step(items))
            base = rows[0]["step_ms"] if rows else ms  # ks start at 0
            rows.append(
                {
                    "batch": vb,
                    "k": k,
                    "context": ctx,
                    "step_ms": ms,
                    "extra_ms_per_k": (ms - base) / k if k else 0.0,
                    "extra_ms_per_token": (ms - base) / (k * vb) if k else 0.0,
                }
            )
            log(f"verify batch {vb} k={k}: {ms:.2f} ms/step")
        return decode, rows

    # -- d) load -------------------------------------------------------------------------------------
    def load(self, name: str, folder: Path) -> list[dict[str, Any]]:
        files = sorted(folder.glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        rows = []
        for state in ("cold", "warm"):
            evicted = state == "cold" and drop_from_page_cache(files)
            self.sync()
            t0 = time.perf_counter()
            model = load_model(folder, dtype=self.dtype, device=self.device)
            self.sync()
            s = time.perf_counter() - t0
            del model
            self.free()
            note = "evicted (fadvise)" if evicted else ("could not evict" if state == "cold" else "cached")
            rows.append({"model": name, "state": state, "page_cache": note, "bytes": nbytes, "load_s": s,
                         "gb_s": nbytes / s / 1e9})  # fmt: skip
            log(f"load {name} ({state}, {note}): {s:.2f} s, {nbytes / s / 1e9:.2f} GB/s")
        return rows


def drop_from_page_cache(files: list[Path]) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    if len(xs) < 2:
        return ys[0] if ys else 0.0, 0.0
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)\n"
    cols = list(rows[0])

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target", help=f"preset or HF folder (default {FULL['target']})")
    p.add_argument("--draft", help=f"preset or HF folder (default {FULL['draft']}); 'none' to skip")
    p.add_argument("--contexts", type=ints, help="restore/recompute contexts, comma-separated")
    p.add_argument("--batches", type=ints, help="decode batch sizes, comma-separated")
    p.add_argument("--ks", type=ints, help="drafts per request for the verification cost")
    p.add_argument("--decode-context", type=int)
    p.add_argument("--verify-batch", type=int)
    p.add_argument("--chunk", type=int, help="prefill chunk (tokens)")
    p.add_argument("--page-size", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--weights-dir", type=Path, help="where to write the safetensors (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/bench_torch"))
    p.add_argument("--quick", action="store_true", help="tiny presets and sizes: a CPU smoke run")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.ks = sorted({0, *args.ks})
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = Bench(args)
    dev = (
        torch.cuda.get_device_name(bench.device)
        if bench.device.type == "cuda"
        else platform.processor() or "cpu"
    )
    env = {"device": dev, "torch": torch.__version__, "dtype": args.dtype, "target": args.target,
           "draft": args.draft, "page_size": args.page_size, "quick": args.quick, "repeats": args.repeats,
           "warmup": args.warmup}  # fmt: skip
    log(f"bench on {dev}: {env}")
    out: dict[str, Any] = {"env": env}
    weights = args.weights_dir or Path(tempfile.mkdtemp(prefix="bench_torch_weights_"))
    cfg = resolve_config(args.target)

    t0 = time.perf_counter()
    target = load_or_init(args.target, args.seed, dtype=bench.dtype, device=bench.device)
    bench.sync()
    log(f"target {args.target}: weights (random for a preset) in {time.perf_counter() - t0:.1f} s")
    out["restore_vs_recompute"] = bench.restore_vs_recompute(target)
    bench.free()  # each measurement's cache is gone once it returns
    out["decode"], out["verify"] = bench.decode_and_verify(target, args.batches, verify=True)
    bench.free()
    save_model(target, weights / "target")
    del target
    bench.free()
    out["load"] = bench.load(args.target, weights / "target")
    out["draft_decode"] = []
    if args.draft != "none":
        draft = load_or_init(args.draft, args.seed, dtype=bench.dtype, device=bench.device)
        out["draft_decode"], _ = bench.decode_and_verify(draft, args.batches, verify=False)
        bench.free()
        save_model(draft, weights / "draft")
        del draft
        bench.free()
        out["load"] += bench.load(args.draft, weights / "draft")

    rvr, dec = out["restore_vs_recompute"], out["decode"]
    single_chunk = [r for r in rvr if r["context"] <= args.chunk] or rvr[:1]
    step0, per_seq = fit_line([r["batch"] for r in dec], [r["step_ms"] for r in dec])
    d0, d_per_seq = fit_line(
        [r["batch"] for r in out["draft_decode"]], [r["step_ms"] for r in out["draft_decode"]]
    )
    out["derived"] = {
        "kv_bytes_per_token": cfg.kv_bytes_per_token(bench.dtype),
        "prefill_tok_s": single_chunk[-1]["prefill_tok_s"],
        "prefill_tok_s_longest_context": rvr[-1]["prefill_tok_s"],
        "decode_step_ms_fixed": step0,
        "decode_ms_per_batch_element": per_seq,
        "draft_decode_step_ms_fixed": d0,
        "draft_decode_ms_per_batch_element": d_per_seq,
        "verify_ms_per_extra_token": statistics.median(
            [r["extra_ms_per_token"] for r in out["verify"] if r["k"]] or [0.0]
        ),
        "restore_h2d_gb_s": rvr[-1]["h2d_gb_s"],
        "load_gb_s_cold": next(r["gb_s"] for r in out["load"] if r["state"] == "cold"),
        "load_gb_s_warm": next(r["gb_s"] for r in out["load"] if r["state"] == "warm"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    md = [f"# bench_torch: {args.target} (draft {args.draft}), {args.dtype} on {dev}\n", table([env])]
    titles = {
        "restore_vs_recompute": "a) restore (H2D import_pages) vs recompute (chunked prefill)",
        "decode": f"b) target decode step vs batch (context {args.decode_context})",
        "draft_decode": f"b') draft decode step vs batch (context {args.decode_context})",
        "verify": "c) verification: one step, k drafts per request",
        "load": "d) weight load from local safetensors",
    }
    for key, title in titles.items():
        md += [f"\n## {title}\n", table(out[key])]
    md += [
        "\n## e) derived constants\n",
        table([{"constant": k, "value": v} for k, v in out["derived"].items()]),
    ]
    (args.out / "results.md").write_text("".join(md))
    if args.weights_dir is None:
        shutil.rmtree(weights, ignore_errors=True)
    log(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    print("".join(md))


if __name__ == "__main__":
    main()
