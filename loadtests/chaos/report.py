"""A chaos run's report: report.md (faults and outcomes tables, violations) and timeline.png."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from loadtests.chaos.checker import CheckReport


def fault_rows(history: dict[str, Any]) -> list[dict[str, Any]]:
    """Every injection and undo/heal, in time order: t, spec, what it hit, whether it took effect."""
    rows = []
    for f in history.get("faults", []):
        rows.append(
            {
                "t": f["t"],
                "spec": f["spec"],
                "action": f["mode"],
                "hit": f.get("worker") or "",
                "ok": f["ok"],
                "error": f.get("error") or "",
            }
        )
    for f in history.get("net_faults", []):
        hit = " / ".join(",".join(side) for side in f.get("hosts", []) if side)
        rows.append(
            {
                "t": f["t"],
                "spec": f["spec"],
                "action": f["mode"],
                "hit": hit,
                "ok": f["ok"],
                "error": f.get("error") or "",
            }
        )
    return sorted(rows, key=lambda r: r["t"])


def write_markdown(history: dict[str, Any], rep: CheckReport, path: Path, *, title: str) -> None:
    lines = [f"# {title}", ""]
    reqs = history.get("requests", [])
    lines += [
        "| requests | exact | clean errors | resumed streams | events checked | incarnations FAILED | violations |",
        "|---|---|---|---|---|---|---|",
        f"| {rep.requests} | {rep.exact} | {rep.clean_errors} | {rep.resumed} | {rep.events_checked} | "
        f"{rep.failed_events} | {len(rep.violations)} |",
        "",
        "Faults injected, by kind: "
        + (", ".join(f"{k} {v}" for k, v in sorted(rep.faults.items())) or "none"),
        "",
    ]
    if history.get("delay_backend"):
        how = {"netem": "tc netem", "nfqueue": "the NFQUEUE delayer (userspace; no sch_netem here)"}
        lines += [
            f"Delay and jitter injected by {how.get(history['delay_backend'], history['delay_backend'])}.",
            "",
        ]
    if history.get("restarts") is not None:
        lines += [
            f"Worker process restarts: {history['restarts']}; gateway restarts: {history.get('gateway_restarts')}",
            "",
        ]
    lines += [
        "## Faults",
        "",
        "| t (s) | spec | action | hit | took effect | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in fault_rows(history):
        cells = [
            f"{r['t']:.2f}",
            f"`{r['spec']}`",
            r["action"],
            r["hit"],
            "yes" if r["ok"] else "no",
            r["error"][:120],
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "## Outcomes by request", ""]
    bad = {v.request for v in rep.violations if v.request is not None}
    ends = Counter(
        "violation" if h["idx"] in bad else "exact" if h.get("error") is None else "clean error" for h in reqs
    )
    lines += [", ".join(f"{k}: {v}" for k, v in sorted(ends.items())) or "no requests", ""]
    lines += ["## Violations", ""]
    lines += [f"- {v.rule}: request {v.request}: {v.detail}" for v in rep.violations] or ["none"]
    path.write_text("\n".join(lines) + "\n")


def plot_timeline(history: dict[str, Any], rep: CheckReport, path: Path) -> str | None:
    """timeline.png: one line per request (green exact, orange clean error, red violation; dots where
    it resumed), fault spans shaded, FAILED verdicts marked. Returns why not, if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lumen[plots]')"
    reqs = history.get("requests", [])
    bad = {v.request for v in rep.violations if v.request is not None}
    fig, (ax, axw) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=(3, 1))
    for h in reqs:
        if h.get("sent_at") is None:
            continue
        color = "red" if h["idx"] in bad else "tab:green" if h.get("error") is None else "tab:orange"
        ax.plot([h["sent_at"], h.get("ended_at") or h["sent_at"]], [h["idx"]] * 2, color=color, lw=1.2)
        for a in h.get("attempts", [])[1:]:
            ax.plot(a["t"], h["idx"], ".", color="black", ms=4)
    spans = _spans(history)
    kinds = sorted({_kind(label) for _, _, label in spans})
    kind_color = {k: f"C{i % 10}" for i, k in enumerate(kinds)}
    for i, (start, end, label) in enumerate(spans):
        for a in (ax, axw):
            a.axvspan(start, end, color=kind_color[_kind(label)], alpha=0.18, lw=0)
        if len(spans) <= 10:  # a few: each labelled; many: a legend by kind
            ax.text(start, len(reqs) * (0.98 - 0.05 * (i % 6)), label, fontsize=6, va="top")
    for k in kinds:
        ax.plot([], [], color=kind_color[k], alpha=0.4, lw=6, label=k)
    for h in reqs:  # violations and clean errors stand out over thousands of lines
        if h["idx"] in bad or h.get("error") is not None:
            marker = ("X", "red") if h["idx"] in bad else ("o", "tab:orange")
            ax.plot(h.get("ended_at") or h["sent_at"], h["idx"], marker[0], color=marker[1], ms=7)
    ax.plot([], [], "X", color="red", label="violation")
    ax.plot([], [], "o", color="tab:orange", label="clean error")
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    workers = sorted({e["worker"] for e in history.get("state_events", [])})
    for e in history.get("state_events", []):
        if e["to"] in ("FAILED", "SUSPECT", "HEALTHY") and e["t"] >= 0:
            y = workers.index(e["worker"]) + 0.15 * e["gateway"]
            style = {"FAILED": ("x", "red"), "SUSPECT": ("|", "orange"), "HEALTHY": ("o", "tab:green")}[
                e["to"]
            ]
            axw.plot(e["t"], y, style[0], color=style[1], ms=5)
    axw.set_yticks(range(len(workers)), workers)
    axw.set_xlabel("seconds after the load started")
    axw.set_ylabel("gateway verdicts\n(x FAILED, o HEALTHY)")
    ax.set_ylabel("request")
    ax.set_title(f"chaos run: {rep.requests} requests, {len(rep.violations)} violations")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _kind(spec: str) -> str:
    kind, _, rest = spec.partition(":")
    if kind == "partition":
        return "partition (one way)" if ">" in rest.partition("@")[0] else "partition"
    return kind


def _spans(history: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start, end, label) of each fault that took effect (end: its undo/heal, else the load's end)."""
    end_of_run = float(history.get("t_load_end", 0.0))
    out = []
    rows = fault_rows(history)
    for i, r in enumerate(rows):
        if (
            r["action"] in ("heal", "heal-at-end")
            or not r["ok"]
            or r["action"] in ("resume", "unstall", "normal")
        ):
            continue
        end = next(
            (
                x["t"]
                for x in rows[i + 1 :]
                if x["spec"] == r["spec"] and x["action"] in ("heal", "resume", "unstall", "normal")
            ),
            r["t"] + 0.2 if r["action"] in ("kill",) or r["spec"].startswith("kill") else end_of_run,
        )
        out.append((r["t"], end, r["spec"]))
    return out
