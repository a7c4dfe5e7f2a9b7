"""Speculation-assisted recovery: a restarting worker drafts for a loaded survivor (DESIGN 1.3, 4.5).

Modules: `distribution` (small next-token distributions), `verify` (greedy, exact-seeded and
rejection-sampling verification), `draft_model` (what the drafter server asks of a draft model),
`synthetic_drafter` (the synthetic drafter and the synthetic target's verify step), `torch_drafter`
(a real torch draft model), `drafter` (the drafter's ROUTER server), `client` (the target's DEALER
client and acceptance counts). The models themselves are in `models`. The worker engine imports
this package, which imports `models`, never the other way round.
"""
