"""A real draft model behind the draft plane: a small torch model (another config, or the target's
first layers as a self-draft) proposing k tokens per request.

Per request the drafter keeps the context ids it was synced and its own small paged KV cache. A
proposal prefills whatever ids the cache has not seen yet, then decodes k tokens one by one: greedy
for greedy requests, else a sample at the target's uniform for that position (the drafter couples its
sampling to the target's seeded sampler, so a draft from the same distribution is the target's own
token). The drafts' KV is speculative: the cache's valid length stays at the context, and the next
proposal overwrites those positions with what the target really accepted. The last context id is
always fed again so its logits exist. A state dropped by the server's LRU frees its cache with it.
Tracking contexts needs no model, so a restarting worker's drafter is created before its draft model
is loaded (`model` is set once it is; the drafter role proposes nothing before that).

Rejection-sampling verification needs the proposal distributions (`want_q`); this drafter does not
provide them (Lumen verifies by exact match), and says so in the Proposal (q = None).
"""

from __future__ import annotations

from collections.abc import Sequence

from draft_models.draft_model import DraftState, Proposal
from models.paging import pages_for
from models.synthetic import Sampler
from models.torch_kv_cache import PagedKVCache
from models.torch_model import BatchItem, CausalLM
from models.torch_sampling import sample_token

PAGE_SIZE = 16


class TorchDraftState(DraftState):
    __slots__ = ("cache", "ids", "kv_len")

    def __init__(self, context: Sequence[int]) -> None:
        super().__init__(0, len(context))
        self.ids = list(context)
        self.kv_len = 0  # context positions whose KV is in `cache`
        self.cache: PagedKVCache | None = None


class TorchDrafter:
    """The `DraftModel` of draft_models/drafter.py over a torch model."""

    def __init__(self, model: CausalLM | None = None) -> None:
        self.model = model

    def start(self, context: Sequence[int]) -> TorchDraftState:
        return TorchDraftState(context)

    def sync(self, state: DraftState, tokens: Sequence[int]) -> None:
        st = _state(state)
        st.ids.extend(tokens)
        st.position = len(st.ids)

    def propose(self, state: DraftState, k: int, sampler: Sampler, *, want_q: bool = False) -> Proposal:
        st = _state(state)
        model = self.model
        if model is None or k <= 0 or not st.ids:
            return Proposal((), None)
        cache = self._cache_for(model, st, len(st.ids) + k)
        table = list(range(cache.num_pages))
        start = min(st.kv_len, len(st.ids) - 1)
        logits = model.forward_batch([BatchItem(table, start, st.ids[start:])], cache)[0][-1]
        position = len(st.ids)
        tokens: list[int] = []
        for i in range(k):
            token = sample_token(logits, sampler, position)
            tokens.append(token)
            if i + 1 < k:
                logits = model.forward_batch([BatchItem(table, position, [token])], cache)[0][-1]
            position += 1
        st.kv_len = len(st.ids) - 1  # the last id is fed again next time: its logits are needed
        return Proposal(tuple(tokens), None)

    @staticmethod
    def _cache_for(model: CausalLM, st: TorchDraftState, tokens: int) -> PagedKVCache:
        cache = st.cache
        if cache is None or cache.num_pages * cache.page_size < tokens:
            # grow by doubling; the new cache starts empty, so the context is prefilled again
            pages = pages_for(2 * tokens, PAGE_SIZE)
            cache = PagedKVCache(model.cfg, pages, PAGE_SIZE, dtype=model.dtype, device=model.device)
            st.cache, st.kv_len = cache, 0
        return cache


def _state(state: DraftState) -> TorchDraftState:
    if not isinstance(state, TorchDraftState):
        raise TypeError("not a torch drafter's state")
    return state
