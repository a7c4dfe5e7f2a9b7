"""The torch model's architecture as data: `ModelConfig` (HF config.json in and out, model_type "qwen3"
or "llama"), `PRESETS` (tiny test models and the real Qwen3 shapes), and the dtype names.

The compute is in `torch_model` (the decoder) and `torch_kv_cache` (the paged KV cache); the weights
(random, loaded, saved) in `torch_weights`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True  # Qwen3 has per-head RMSNorm on q and k; Llama does not
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """From a HuggingFace config.json dict (model_type "qwen3" or "llama")."""
        kind = d.get("model_type")
        if kind not in ("qwen3", "llama"):
            raise ValueError(f"model_type {kind!r} is not supported (qwen3 or llama)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (silu)")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias/mlp_bias: biases are not supported")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling {rope!r} is not supported (plain RoPE only)")
        heads = d["num_attention_heads"]
        theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10_000.0))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            qk_norm=kind == "qwen3",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        kind = "qwen3" if self.qk_norm else "llama"
        return {
            "architectures": ["Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"],
            "model_type": kind,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
        }

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def truncated(self, num_layers: int) -> ModelConfig:
        """The same model keeping its first `num_layers` layers (a self-draft)."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        return dataclasses.replace(self, num_layers=num_layers)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool = False) -> ModelConfig:
    return ModelConfig(151936, hidden, inter, layers, heads, 8, 128, tie_word_embeddings=tied)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(259, 64, 128, 2, 4, 2, 16),
    "tiny-llama": ModelConfig(259, 64, 128, 2, 4, 2, 16, qk_norm=False),
    "tiny-draft": ModelConfig(259, 32, 64, 1, 2, 1, 16),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64),
}


def resolve_config(name_or_path: str) -> ModelConfig:
    """A preset's config, or the one in `<folder>/config.json`."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with config.json"
        )
    return ModelConfig.from_hf(json.loads(path.read_text()))


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]
