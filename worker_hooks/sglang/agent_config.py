"""What the sidecar agent is told (`SidecarConfig`): the server it runs beside, the gateways it attaches
to, its poll rates and seeded-reload timeouts, and where the server's holder stores and plane file are;
checked once, when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from worker_hooks.sglang.launcher import host_port, weights_group_ports
from worker_hooks.sglang.storage_layout import shard_endpoint, status_endpoint_for

# how long a gateway waits for a draft round of the agent's drafter, unless told (its draft.draft_timeout_ms)
DRAFT_TIMEOUT_MS: Final = 1000.0


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    worker_id: str
    url: str  # the server's http://host:port, as the gateway will reach it
    gateways: tuple[str, ...]  # control-plane host:port of each gateway
    token: str = ""  # the control-plane secret (LUMEN_CONTROL_TOKEN; gateway/protocol/secrets.py)
    tls_ca: str = ""  # PEM the gateways' control-plane certificates chain to; "": plaintext
    model: str = ""
    failure_domain: str = ""
    poll_interval_s: float = 0.1
    poll_misses: int = 5  # no 200 from /ready for poll_interval_s x poll_misses: the server is lost
    heartbeat_interval_ms: int = 50  # when a Welcome names none
    abort_timeout_s: float = 2.0
    tp: int = 1  # the server's tensor parallelism: a seed must have the same
    seed_wait_s: float = 2.0  # after the server died, how long to wait for a ReloadFrom (0: never seed)
    seed_timeout_s: float = 300.0  # a seeded server not ready by then is killed and loaded from storage
    weights_group_ports: tuple[int, ...] = ()  # one per TP rank; empty: from the url's port
    # Lumen's storage backend in the server (part 2): where its holder store listens and its budget;
    # reported in Hello so the gateway can make this server a checkpoint holder ("": it holds nothing)
    kv_endpoint: str = ""
    ckpt_budget_bytes: int = 0
    # its holder stores' status sockets (shard 0; rank r at shard_endpoint(base, r)); "": derived from
    # kv_endpoint (`storage_layout.status_endpoint_for`), as the storage backend derives it
    holder_status_endpoint: str = ""
    holder_shards: int = 0  # holder stores (ranks) to poll; 0: tp
    # the server's plane file (keys and members for its KV plane, plane_file.py; LUMEN_PLANE_FILE): "": a
    # private one the agent creates, and gives a server it launches
    plane_file: str = ""
    # the batch the gateway holds a server launched with room for the outage boost to (Hello.held_batch;
    # launcher.with_headroom); 0: not held
    held_batch: int = 0
    # the server's --page-size as launched (Hello.page_size); 0: not known (a server started elsewhere
    # without one in the launch arguments)
    page_size: int = 0
    # the server's API key (server_key.py): sent on the agent's requests to it and in Hello; "": none
    api_key: str = field(default="", repr=False)
    # a draft model (Hugging Face folder, the target's tokenizer) the agent drafts with while the server
    # it relaunched loads (agent_draft.py); "": no drafting. On `draft_device` (torch's name)
    draft_model: str = ""
    draft_device: str = "cpu"
    draft_timeout_ms: float = DRAFT_TIMEOUT_MS  # the gateway's draft.draft_timeout_ms

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("the agent needs at least one gateway")
        if len(set(self.gateways)) != len(self.gateways):
            raise ValueError(f"a gateway is named twice: {self.gateways}")
        if self.poll_interval_s <= 0 or self.poll_misses < 1:
            raise ValueError("poll_interval_s must be > 0 and poll_misses >= 1")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, not {self.tp}")
        if self.page_size < 0:
            raise ValueError(f"page_size must be >= 0, not {self.page_size}")
        if self.holder_shards < 0:
            raise ValueError(f"holder_shards must be >= 0, not {self.holder_shards}")
        if self.seed_wait_s < 0 or self.seed_timeout_s <= 0:
            raise ValueError("seed_wait_s must be >= 0 and seed_timeout_s > 0")
        if self.draft_timeout_ms <= 0:
            raise ValueError(f"draft_timeout_ms must be > 0, not {self.draft_timeout_ms}")
        if self.weights_group_ports and len(self.weights_group_ports) < self.tp:
            raise ValueError(
                f"{len(self.weights_group_ports)} weights group port(s) for tp {self.tp}: one per TP rank"
            )

    def group_ports(self) -> list[int]:
        """The weight-transfer group ports a seeded launch names (one per TP rank)."""
        if self.weights_group_ports:
            return list(self.weights_group_ports[: self.tp])
        return weights_group_ports(host_port(self.url)[1], self.tp)

    def status_endpoints(self) -> list[str]:
        """The status sockets of the server's holder stores, rank order (none without a kv_endpoint)."""
        if not self.kv_endpoint:
            return []
        base = self.holder_status_endpoint or status_endpoint_for(self.kv_endpoint)
        return [shard_endpoint(base, r) for r in range(self.holder_shards or self.tp)]
