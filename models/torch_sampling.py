"""Sampling one token from a real model's logits under a request's `Sampler` (models/synthetic.py).

It keeps the gateway's replay contract: greedy is argmax; otherwise temperature, top-k and top-p, then
the CDF is inverted at the uniform of `(seed_base, position)`, so a seeded request samples the same
token at the same position on any worker. The torch scheduler and the torch drafter both sample here.

`token_logprob` is SGLang's logprob (srt/layers/sampler.py, its default): the log-softmax of the
logits divided by the temperature (1 for a greedy request), before top-k and top-p, in float64.
"""

from __future__ import annotations

import math

import torch

from gateway.protocol.generate import TokenLogprob
from models.synthetic import Sampler


def sample_token(logits: torch.Tensor, sampler: Sampler, position: int) -> int:
    """The token at absolute `position` from its logits ([vocab], float32): argmax when greedy, else
    temperature, top-k (0: off) and top-p, then the CDF inverted at the uniform for `position`."""
    if sampler.greedy:
        return int(torch.argmax(logits))
    x = logits.to(torch.float64) / sampler.temperature
    top_k = sampler.top_k
    if 0 < top_k < x.numel():
        vals, idx = torch.topk(x, top_k)  # sorted, largest first
    else:
        vals, idx = torch.sort(x, descending=True, stable=True)
    probs = torch.softmax(vals, dim=0)
    cdf = torch.cumsum(probs, dim=0)
    keep = cdf.numel()
    if sampler.top_p < 1.0:
        # the shortest prefix whose mass reaches top_p (at least one token)
        keep = min(keep, int(torch.searchsorted(cdf, torch.tensor(sampler.top_p, dtype=cdf.dtype))) + 1)
    total = float(cdf[keep - 1])
    target = torch.tensor(sampler.uniform(position) * total, dtype=cdf.dtype)
    i = min(int(torch.searchsorted(cdf[:keep], target, right=True)), keep - 1)
    return int(idx[i])


def token_logprob(logits: torch.Tensor, sampler: Sampler, token: int, top_n: int = 0) -> TokenLogprob:
    """`token`'s log probability under `logits` ([vocab]) and the `top_n` most likely tokens (most
    likely first); -inf is reported as None."""
    t = 1.0 if sampler.greedy else sampler.temperature
    lp = torch.log_softmax(logits.to(torch.float64) / t, dim=-1)
    top: tuple[tuple[float | None, int], ...] = ()
    if top_n > 0:
        vals, idx = torch.topk(lp, min(top_n, lp.numel()))
        top = tuple((_finite(v), int(i)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True))
    return TokenLogprob(token, _finite(float(lp[token])), top)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
