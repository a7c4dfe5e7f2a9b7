"""The models a worker runs and a drafter drafts with, below both: no serving machinery here.

Modules: `synthetic` (the deterministic synthetic model, the per-request `Sampler`, `expected_output`),
`paging` (page arithmetic shared by the engine's page pool and every paged KV cache), and the torch
model: `torch_config` (architecture, presets, dtypes), `torch_model` (the Qwen3/Llama decoder),
`torch_kv_cache` (its paged KV cache), `torch_weights` (random, loaded and saved weights),
`torch_sampling` (a token from real logits). Only the `torch_*` modules import torch.

Imports: `gateway.protocol` (and `gateway.core`) only; nothing of the worker engine, the draft plane,
the gateway's server or simulator, or the load tests, all of which may import this package.
"""
