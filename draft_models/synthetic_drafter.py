"""The synthetic draft model: a drafter for the synthetic target whose agreement rate is a knob.

At every draft position the drafter either agrees (proposes exactly the token the target would produce
there: its greedy token, or its seeded sample for `(seed_base, position)`) or proposes an "off" token:
a valid id in [token_lo, token_hi) that is none of the target's K candidates, so the target never
produces it. Whether it agrees is decided by a hash of (model seed, draft seed, context state,
position) against `agreement`: deterministic, no global random, and independent of the target's own
sampling uniform. Acceptance per draft token is therefore `agreement` for greedy and exact-seeded
verification alike.

For rejection sampling the proposal is q = agreement·p + (1 - agreement)·δ_off, p being the target's
distribution (`target_dist`): an agreeing draft is a sample of p (always accepted, as p/q = 1/agreement
≥ 1), an off draft has p = 0 (always rejected, and the residual norm(max(0, p - q)) is p itself), so
the acceptance rate is again `agreement` and the output distribution is p.

Per request the drafter keeps only the rolling context hash (its "KV") and the context length, so
drafting k tokens costs O(k) and a sync costs O(new ids). Proposing never moves the state: drafts are
speculative; the target's next sync carries what was really accepted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from draft_models.distribution import Dist, mix, target_dist
from draft_models.draft_model import DraftState, Proposal
from draft_models.verify import Uniforms, Verdict, VerifyMode, verify_match, verify_rejection
from models.synthetic import K_CANDIDATES, MASK64, Sampler, SyntheticModel, mix64

_AGREE_SALT = 0x4452_4146_5441_4752  # "DRAFTAGR"
_OFF_SALT = 0x4452_4146_544F_4646  # "DRAFTOFF"
_INV_2_64 = 1.0 / 18446744073709551616.0


class SyntheticDrafter:
    def __init__(
        self,
        agreement: float,
        *,
        model_seed: int = 0,
        token_lo: int = 32,
        token_hi: int = 127,
        draft_seed: int = 0,
    ) -> None:
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"agreement must be in [0, 1], got {agreement}")
        if token_hi - token_lo <= K_CANDIDATES:
            # an off token must exist outside the K candidates
            raise ValueError(
                f"the drafter needs more than {K_CANDIDATES} token ids, got [{token_lo}, {token_hi})"
            )
        self.agreement = agreement
        self.target = SyntheticModel(model_seed, token_lo, token_hi)
        key = mix64((model_seed & MASK64) ^ _AGREE_SALT)
        self._agree_key = mix64(key ^ (draft_seed & MASK64))
        self._off_key = mix64(self._agree_key ^ _OFF_SALT)

    # -- state ----------------------------------------------------------------------------------
    def start(self, context: Sequence[int]) -> DraftState:
        return DraftState(self.target.absorb(self.target.initial_state(), list(context)), len(context))

    def sync(self, state: DraftState, tokens: Sequence[int]) -> None:
        state.h = self.target.absorb(state.h, list(tokens))
        state.position += len(tokens)

    # -- drafting -------------------------------------------------------------------------------
    def agrees(self, h: int, position: int) -> bool:
        u = mix64(mix64(h ^ self._agree_key) ^ (position & MASK64)) * _INV_2_64
        return u < self.agreement

    def off_token(self, h: int) -> int:
        """A valid id that is none of the target's candidates at state `h`."""
        lo, span = self.target.token_lo, self.target.token_hi - self.target.token_lo
        taken = {token for _, token in self.target.candidates(h)}
        offset = mix64(h ^ self._off_key) % span
        while lo + offset in taken:
            offset = (offset + 1) % span
        return lo + offset

    def proposal_dist(self, h: int, sampler: Sampler) -> Dist:
        return mix(target_dist(self.target, h, sampler), self.off_token(h), 1.0 - self.agreement)

    def propose(self, state: DraftState, k: int, sampler: Sampler, *, want_q: bool = False) -> Proposal:
        h, position = state.h, state.position
        tokens: list[int] = []
        q: list[Dist] = []
        for _ in range(k):
            if self.agrees(h, position):
                token = self.target.next_token(h, position, sampler)
            else:
                token = self.off_token(h)
            if want_q:
                q.append(self.proposal_dist(h, sampler))
            tokens.append(token)
            h = mix64(h ^ token)
            position += 1
        return Proposal(tuple(tokens), tuple(q) if want_q else None)


# -- the target's side ------------------------------------------------------------------------------
def _target_tokens(
    model: SyntheticModel, h: int, position: int, sampler: Sampler, drafts: Sequence[int]
) -> Iterator[int]:
    for i in range(len(drafts) + 1):
        yield model.next_token(h, position + i, sampler)
        if i < len(drafts):
            h = mix64(h ^ drafts[i])


def _target_dists(model: SyntheticModel, h: int, sampler: Sampler, drafts: Sequence[int]) -> Iterator[Dist]:
    for i in range(len(drafts) + 1):
        yield target_dist(model, h, sampler)
        if i < len(drafts):
            h = mix64(h ^ drafts[i])


def verify_synthetic(
    model: SyntheticModel,
    h: int,
    position: int,
    sampler: Sampler,
    drafts: Sequence[int],
    *,
    mode: VerifyMode,
    q_rows: Sequence[Dist] | None = None,
    uniforms: Uniforms | None = None,
) -> Verdict:
    """Verify `drafts` proposed after a context with state `h` and length `position` on the synthetic
    target. Lazy: target tokens (or distributions) are computed only up to the first rejection."""
    if mode is not VerifyMode.REJECTION:
        return verify_match(drafts, _target_tokens(model, h, position, sampler, drafts))
    if q_rows is None or uniforms is None:
        raise ValueError("rejection sampling needs the drafts' q distributions and the request's uniforms")
    return verify_rejection(drafts, q_rows, _target_dists(model, h, sampler, drafts), uniforms, position)
