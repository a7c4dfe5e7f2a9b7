"""Randomized fault schedules for `lumen chaos`, drawn from a seed (the same seed, the same schedule).

Faults arrive at `rate_per_min` on average, uniformly over the run (none in its first 1.5 s or its
last 4 s, so the load sees each one), each of a kind drawn with the weights below and lasting 0.5–4 s
where it can be undone. Kinds that need more hosts than the lab has are not drawn (gateway faults with
one gateway), nor delay where this machine cannot inject it (`delay`: False; netfaults.delay_backend).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

WEIGHTS: dict[str, int] = {
    "partition-gw-worker": 3,  # a worker cut from one gateway or all, both ways
    "partition-one-way": 1,  # a worker's packets to the gateways dropped (theirs arrive)
    "partition-workers": 2,  # two workers cut apart (serving worker vs its holder)
    "partition-gateway": 1,  # a gateway cut from every other host (its clients resume elsewhere)
    "loss": 2,
    "bw": 1,
    "delay": 1,
    "kill": 2,
    "hang": 1,
    "kill-gateway": 1,
}


def random_faults(
    seed: int,
    duration_s: float,
    rate_per_min: float,
    *,
    gateways: Sequence[str],
    workers: Sequence[str],
    delay: bool,
) -> list[str]:
    if duration_s < 6:
        raise ValueError(f"a randomized run needs at least 6 s, not {duration_s:g}")
    rng = random.Random(seed)
    n = round(duration_s / 60.0 * rate_per_min)
    kinds = [k for k in WEIGHTS if _possible(k, len(gateways), len(workers), delay)]
    weights = [WEIGHTS[k] for k in kinds]
    times = sorted(round(rng.uniform(1.5, duration_s - 4.0), 1) for _ in range(n))
    out: list[str] = []
    used: set[tuple[float, str]] = set()
    for t in times:
        kind = rng.choices(kinds, weights)[0]
        d = round(rng.uniform(0.5, 4.0), 1)
        w = rng.choice(list(workers))
        g = rng.choice(list(gateways))
        if (t, w) in used:  # two process faults on one worker at one instant are refused
            t = round(t + 0.1, 1)
        used.add((t, w))
        out.append(_spec(kind, rng, t, d, w, g, workers, gateways))
    return out


def _possible(kind: str, gateways: int, workers: int, delay: bool) -> bool:
    if kind in ("partition-gateway", "kill-gateway"):
        return gateways > 1
    if kind == "partition-workers":
        return workers > 1
    if kind == "delay":
        return delay
    return True


def _spec(
    kind: str,
    rng: random.Random,
    t: float,
    d: float,
    w: str,
    g: str,
    workers: Sequence[str],
    gateways: Sequence[str],
) -> str:
    when = f"@{t:g}+{d:g}"
    if kind == "partition-gw-worker":
        return f"partition:{w}|{rng.choice([g, 'gw'])}{when}"
    if kind == "partition-one-way":
        return f"partition:{w}>gw{when}"
    if kind == "partition-workers":
        other = rng.choice([x for x in workers if x != w])
        return f"partition:{w}|{other}{when}"
    if kind == "partition-gateway":
        return f"partition:{g}|all{when}"
    if kind == "loss":
        return f"loss:all{when}:pct={rng.choice([2, 5, 10])}"
    if kind == "bw":
        return f"bw:{w}{when}:rate={rng.choice(['1mbit', '5mbit', '20mbit'])}"
    if kind == "delay":
        return f"delay:all{when}:ms=25:jitter=25"
    if kind == "kill":
        return f"kill:{w}@{t:g}"
    if kind == "hang":
        return f"hang:{w}{when}"
    return f"kill-gateway:{gateways.index(g)}@{t:g}"
