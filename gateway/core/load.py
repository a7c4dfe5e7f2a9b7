"""The estimated recovery load `L̂(w) = α·ckpt(w) + β·queue(w)` (DESIGN 6)."""

from __future__ import annotations

from gateway.core.types import LoadParams, WorkerView


def checkpoint_term(w: WorkerView) -> float:
    """Checkpointed KV tokens w holds, as a fraction of its KV capacity (what it absorbs on restore)."""
    return w.ckpt_tokens / max(1, w.kv_capacity_tokens)


def queue_term(w: WorkerView, nominal_batch: int) -> float:
    """Requests running, waiting, and routed-but-unreported, over the nominal batch size."""
    return (w.running + w.waiting + w.pending) / max(1, nominal_batch)


def estimated_load(w: WorkerView, params: LoadParams) -> float:
    return params.alpha * checkpoint_term(w) + params.beta * queue_term(w, params.nominal_batch)
