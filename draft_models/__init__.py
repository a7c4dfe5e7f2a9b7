"""Speculation-assisted recovery: a restarting worker drafts for a loaded survivor (DESIGN 1.3, 4.5).

Modules: `registry` (target -> draft pairs, vocabulary checks), `distribution` (small next-token
distributions), `verify` (greedy, exact-seeded and rejection-sampling verification), `synthetic` (the
synthetic drafter and the synthetic target's verify step), `drafter` (the drafter's ROUTER server),
`assist` (the target's DEALER client and acceptance counts).
"""
