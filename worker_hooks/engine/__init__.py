"""Lumen's own worker: an SGLang-compatible server over a continuous-batching engine.

Modules: `synthetic` (the deterministic model and `expected_output`), `pages` (paged KV accounting),
`scheduler` (step composition, draft verification), `engine` (the real-time step loop), `loading`
(a starting worker's phase plan), `checkpointing` (the worker's checkpoint store, page streaming and
restore lookup), `assist` (the draft-assist roles: `drafting` for a restarting worker's drafter,
`speculative` for a target's drafts and adaptive k), `handle` (one request's emissions),
`validation` (admission checks), `server` and `info` (HTTP), `openai_compat` (OpenAI `/v1/completions`
and `/v1/chat/completions` on the same engine path), `metrics`, `worker` (`start_worker`,
in-process), `__main__` (the process entry point).
"""
