"""What one chaos run does, as data: the lab's hosts, the cluster, the load and the fault schedule.

The orchestrator (loadtests/chaos/orchestrate.py, in the machine's own namespace) writes a Plan; the
driver (loadtests/chaos/driver.py) reads it inside the load client's namespace and runs it.
Requests are drawn from the seed, so a plan replays exactly: same prompts, same arrivals, same faults.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from loadtests.chaos.netspec import NetFault, is_net_spec, parse_net_fault
from loadtests.faults import FaultSchedule

# the driver logs a progress line this often; the orchestrator shows it (`lumen chaos`)
PROGRESS_S = 30.0
PROGRESS_EVENT = "chaos_progress"


class Plan(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    hosts: dict[str, tuple[str, str]]  # host name -> (namespace, address), in lab order
    gateways: list[str]  # host names of the gateways
    workers: list[str]  # host names of the workers (= worker ids)
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)
    token: str
    admin_key: str
    cert: str
    key: str
    seed: int = 1
    requests: int = 40
    rate: float = 8.0  # arrivals per second (Poisson)
    min_out: int = 40
    max_out: int = 120
    faults: list[str] = msgspec.field(default_factory=list)
    sample_s: float = 0.25  # /admin/workers of every gateway this often
    read_timeout_s: float = 5.0  # client: a stream silent this long is broken (resumed elsewhere)
    drain_s: float = 20.0  # after the load: wait this long at most for every store to empty
    deadline_s: float = 240.0  # the whole run, start-up included
    log_dir: str
    out: str


def split_faults(specs: list[str]) -> tuple[FaultSchedule, list[NetFault]]:
    """Process faults (loadtests/faults.py kinds) and network faults (netspec kinds) of one schedule.
    Raises FaultSpecError / NetSpecError with the spec and the reason."""
    net = [parse_net_fault(s) for s in specs if is_net_spec(s)]
    return FaultSchedule.parse([s for s in specs if not is_net_spec(s)]), net


def request_specs(plan: Plan) -> list[dict[str, Any]]:
    """The run's requests (prompt, length, sampling, arrival), drawn from the plan's seed."""
    rnd = random.Random(plan.seed)
    t = 0.0
    out = []
    for i in range(plan.requests):
        greedy = i % 2 == 0
        out.append(
            {
                "idx": i,
                "prompt_ids": [rnd.randrange(32, 127) for _ in range(rnd.randrange(16, 300))],
                "max_tokens": rnd.randrange(plan.min_out, plan.max_out + 1),
                "temperature": 0.0 if greedy else 0.9,
                "seed": None if greedy else rnd.randrange(1, 2**31),
                "at": round(t, 4),
                "gateway": i % len(plan.gateways),
            }
        )
        t += rnd.expovariate(plan.rate)
    return out
