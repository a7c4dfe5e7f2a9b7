"""Lumen's own worker: an SGLang-compatible server over a continuous-batching engine.

Modules: `pages` (paged KV accounting), `scheduler` (step composition, draft verification),
`torch_scheduler` and `torch_backend` (the same for a real torch model), `engine` (the real-time step
loop), `loading` (a starting worker's phase plan), `checkpointing` (the worker's checkpoint store,
page streaming and restore lookup), `draft_assist` (the draft-assist roles: `drafting` for a
restarting worker's drafter, `speculative` for a target's drafts and adaptive k), `handle` (one
request's emissions), `validation` (admission checks), `errors`, `metrics`; HTTP: `http` (the app key
and JSON responses the routes share), `server` (/generate, abort, health), `info` (discovery, loads,
metrics), `openai_routes` (OpenAI `/v1/completions` and `/v1/chat/completions` on the same engine
path, over gateway.protocol.openai's shapes); `service` (`Worker`, `start_worker`: engine + HTTP app + control agent, in-process),
`__main__` (the process entry point). The models it runs (synthetic and torch) are in `models`.
"""
