"""Roofline cost model shared by the synthetic engine and the simulator (DESIGN 7).

Per step: `t = overhead + max(FLOPs / (peak·mfu), bytes / (hbm_bw·mbu)) + tp_comm`, with
FLOPs ≈ 2·params·tokens + attention and bytes = weights + KV read/written. Every constant says where it
comes from; the H100 figures are the vendor's and the effective ones DESIGN.md starts from, to be
recalibrated from the torch engine on a real GPU.

A restart reloads the full weights from one of two sources (`ReloadSource`, issue 14): its own
storage (`disk`: weight_bytes / (load_bw·tp)) or a running survivor of the same model and TP (`peer`,
SGLang's `--load-format remote_instance`: each TP rank receives its shard from the seed's matching
rank over GPUDirect RDMA, weight_bytes / (peer_bw·tp)); either way plus the engine start-up. While
a seed sends, its own steps are `seed_slowdown()` times slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

GiB = 1024**3
KiB = 1024


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    hbm_bytes: int
    peak_flops: float  # dense bf16, vendor figure
    mfu: float  # achieved fraction on large GEMMs
    hbm_bw: float  # bytes/s, vendor figure
    mbu: float  # achieved fraction when streaming weights
    d2h_bw: float  # device -> host, bytes/s
    h2d_bw: float  # host -> device, bytes/s
    load_bw: float  # weight loading from storage, bytes/s (assumed: local NVMe / network FS)
    tp_allreduce_s: float  # per all-reduce latency inside a TP group (NVLink), seconds
    # GPU -> GPU across nodes (GPUDirect RDMA over the GPU's own NIC), bytes/s per GPU: what a
    # restarting server's rank receives its weight shard at from a seed's matching rank
    peer_bw: float


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float  # parameter count
    layers: int
    q_dim: int  # attention heads x head dim
    kv_bytes_per_token: int  # K and V over all layers, bf16
    vocab_size: int
    default_tp: int
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.bytes_per_param)


# A 400 Gb/s-class NIC per GPU (DGX H100 and DGX H200: eight ConnectX-7 400 Gb/s InfiniBand NDR
# ports, one per GPU, for the compute fabric) is 50 GB/s line rate; RDMA reaches ~90% of it
# (assumed), so 45 GB/s per GPU between a seed's rank and the restarting server's.
PEER_BW_400G = 45e9


class ReloadSource(StrEnum):
    """Where a restarting server's full weights come from."""

    DISK = "disk"  # its own storage (local NVMe / network FS) at load_bw per GPU
    PEER = "peer"  # a running survivor of the same model and TP (the seed) at peer_bw per GPU


RELOAD_SOURCES: tuple[str, ...] = tuple(ReloadSource)

GPUS: dict[str, GpuSpec] = {
    # H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s; effective ~700 TFLOP/s and ~2.85 TB/s (DESIGN 7)
    "H100-80G": GpuSpec(
        name="H100-80G",
        hbm_bytes=80 * 10**9,
        peak_flops=989e12,
        mfu=0.71,
        hbm_bw=3.35e12,
        mbu=0.85,
        d2h_bw=50e9,
        h2d_bw=35e9,
        load_bw=2.0e9,
        tp_allreduce_s=12e-6,
        peer_bw=PEER_BW_400G,
    ),
    # H200: same compute as H100, 141 GB HBM3e at 4.8 TB/s
    "H200": GpuSpec(
        name="H200",
        hbm_bytes=141 * 10**9,
        peak_flops=989e12,
        mfu=0.71,
        hbm_bw=4.8e12,
        mbu=0.85,
        d2h_bw=50e9,
        h2d_bw=35e9,
        load_bw=2.0e9,
        tp_allreduce_s=12e-6,
        peer_bw=PEER_BW_400G,
    ),
}

# Architecture figures from the models' public configs; KV per token = 2·layers·kv_heads·head_dim·2 B.
MODELS: dict[str, ModelSpec] = {
    "Qwen3-0.6B": ModelSpec("Qwen3-0.6B", 0.6e9, 28, 2048, 112 * KiB, 151936, 1),
    "Qwen3-1.7B": ModelSpec("Qwen3-1.7B", 1.7e9, 28, 2048, 112 * KiB, 151936, 1),
    "Qwen3-8B": ModelSpec("Qwen3-8B", 8.2e9, 36, 4096, 144 * KiB, 151936, 1),
    "Qwen3-14B": ModelSpec("Qwen3-14B", 14.8e9, 40, 5120, 160 * KiB, 151936, 1),
    "Qwen3-32B": ModelSpec("Qwen3-32B", 32.8e9, 64, 8192, 256 * KiB, 151936, 2),
    "Llama-3.2-1B": ModelSpec("Llama-3.2-1B", 1.24e9, 16, 2048, 32 * KiB, 128256, 1),
    "Llama-3.1-8B": ModelSpec("Llama-3.1-8B", 8.0e9, 32, 4096, 128 * KiB, 128256, 1),
    "Llama-3-70B": ModelSpec("Llama-3-70B", 70.6e9, 80, 8192, 320 * KiB, 128256, 4),
}

# scheduler + launch overhead per engine step (assumed; SGLang's CPU-side overhead is a few ms)
STEP_OVERHEAD_S = 3e-3
# engine start-up besides weight loading: process start, CUDA context, graph capture (assumed)
ENGINE_STARTUP_S = 20.0
# memory the engine keeps back from KV (activations, CUDA graphs), fraction of HBM
HBM_RESERVE_FRACTION = 0.10


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one batched engine step does.

    `prefill` holds (new tokens, tokens already in context) per prefill chunk; `decode_contexts`
    holds the context length of each decoding request (each decodes one token, plus `verify_tokens`
    extra tokens verified for speculative decoding in total).
    """

    prefill: Sequence[tuple[int, int]] = ()
    decode_contexts: Sequence[int] = ()
    verify_tokens: int = 0


class CostModel:
    """Times for one (model, GPU, TP) deployment."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, step_overhead_s: float = STEP_OVERHEAD_S):
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.step_overhead_s = step_overhead_s

    @staticmethod
    def preset(model: str, gpu: str, tp: int | None = None) -> CostModel:
        if model not in MODELS:
            raise KeyError(f"unknown model preset {model!r}; known: {sorted(MODELS)}")
        if gpu not in GPUS:
            raise KeyError(f"unknown GPU preset {gpu!r}; known: {sorted(GPUS)}")
        m = MODELS[model]
        return CostModel(m, GPUS[gpu], tp if tp else m.default_tp)

    # -- capacity -------------------------------------------------------------------------------
    def kv_capacity_tokens(self) -> int:
        usable = self.tp * self.gpu.hbm_bytes * (1.0 - HBM_RESERVE_FRACTION) - self.model.weight_bytes
        return max(0, int(usable // self.model.kv_bytes_per_token))

    # -- steps ----------------------------------------------------------------------------------
    def step_time(self, work: StepWork) -> float:
        m, g = self.model, self.gpu
        new_tokens = sum(n for n, _ in work.prefill) + len(work.decode_contexts) + work.verify_tokens
        if new_tokens == 0:
            return 0.0
        flops = 2.0 * m.params * new_tokens
        kv_read_tokens = 0
        for n, ctx in work.prefill:
            # causal attention over the chunk: each new token attends to ctx + its position
            flops += 4.0 * m.layers * m.q_dim * n * (ctx + n / 2.0)
            kv_read_tokens += ctx
        for ctx in work.decode_contexts:
            flops += 4.0 * m.layers * m.q_dim * ctx
            kv_read_tokens += ctx
        if work.verify_tokens and work.decode_contexts:
            avg_ctx = sum(work.decode_contexts) / len(work.decode_contexts)
            flops += 4.0 * m.layers * m.q_dim * avg_ctx * work.verify_tokens
        bytes_moved = m.weight_bytes + (kv_read_tokens + new_tokens) * m.kv_bytes_per_token
        compute_s = flops / (g.peak_flops * g.mfu * self.tp)
        memory_s = bytes_moved / (g.hbm_bw * g.mbu * self.tp)
        comm_s = 2 * m.layers * g.tp_allreduce_s if self.tp > 1 else 0.0
        return self.step_overhead_s + max(compute_s, memory_s) + comm_s

    def prefill_time(self, tokens: int, context: int = 0) -> float:
        return self.step_time(StepWork(prefill=((tokens, context),)))

    def decode_step_time(self, contexts: Sequence[int]) -> float:
        return self.step_time(StepWork(decode_contexts=contexts))

    def batch_step_time(self, batch: int, context: float, verify_tokens: int = 0) -> float:
        """`step_time` of a decode step of `batch` requests of mean context `context` verifying
        `verify_tokens` drafts in all, in O(1) (the same roofline; it only uses the sums)."""
        if batch <= 0:
            return 0.0
        m, g = self.model, self.gpu
        new_tokens = batch + verify_tokens
        attn = batch * context + (context * verify_tokens)
        flops = 2.0 * m.params * new_tokens + 4.0 * m.layers * m.q_dim * attn
        bytes_moved = m.weight_bytes + (batch * context + new_tokens) * m.kv_bytes_per_token
        compute_s = flops / (g.peak_flops * g.mfu * self.tp)
        memory_s = bytes_moved / (g.hbm_bw * g.mbu * self.tp)
        comm_s = 2 * m.layers * g.tp_allreduce_s if self.tp > 1 else 0.0
        return self.step_overhead_s + max(compute_s, memory_s) + comm_s

    # -- checkpoint / restore / load -------------------------------------------------------------
    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.model.kv_bytes_per_token

    def restore_time(self, tokens: int, network_bw: float | None = None) -> float:
        """Host DRAM -> GPU for `tokens` of KV (+ the network hop when the pages are remote)."""
        b = self.kv_bytes(tokens)
        t = b / (self.gpu.h2d_bw * self.tp)
        if network_bw:
            t += b / network_bw
        return t

    def offload_time(self, tokens: int) -> float:
        return self.kv_bytes(tokens) / (self.gpu.d2h_bw * self.tp)

    def weights_time(self, source: ReloadSource = ReloadSource.DISK, peer_bw: float | None = None) -> float:
        """The full weights into HBM, sharded over TP ranks loading in parallel: from storage (`disk`),
        or each rank from a seed's matching rank (`peer`, at `peer_bw`, default the GPU's)."""
        if source == ReloadSource.PEER:
            bw = self.gpu.peer_bw if peer_bw is None else peer_bw
        else:
            bw = self.gpu.load_bw
        return self.model.weight_bytes / (bw * self.tp)

    def load_time(
        self,
        engine_startup_s: float = ENGINE_STARTUP_S,
        source: ReloadSource = ReloadSource.DISK,
        peer_bw: float | None = None,
    ) -> float:
        """A (re)start until the engine serves: the weights (`weights_time`) + engine start-up."""
        return self.weights_time(source, peer_bw) + engine_startup_s

    def seed_slowdown(self, peer_bw: float | None = None) -> float:
        """The factor on a seed's step times while it streams its weights to a restarting server.

        The NIC reads the seed's HBM at `peer_bw` (GPUDirect RDMA; with SGLang's TransferEngine
        backend no kernel runs on the seed), and a decode step is bound by HBM bandwidth, so the
        step slows by the share of that bandwidth the transfer takes: 1 + peer_bw / (hbm_bw·mbu)
        (1.016 on H100, 1.011 on H200). A simple bound, applied to every step, compute-bound
        prefill included. SGLang's NCCL backend also runs send kernels on the seed and sets up a
        communicator first, which disturbs serving more: a shell models that with a larger factor.
        """
        bw = self.gpu.peer_bw if peer_bw is None else peer_bw
        return 1.0 + bw / (self.gpu.hbm_bw * self.gpu.mbu)
