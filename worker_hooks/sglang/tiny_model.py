"""Build tiny randomly initialised models that an unmodified SGLang serves on CPU (the real-SGLang lane).

    python -m worker_hooks.sglang.tiny_model OUT_DIR [--seed 0]

writes OUT_DIR/target (a 2-layer Qwen3, hidden 128) and OUT_DIR/draft (a 1-layer Qwen3, hidden 64) that
share one byte-level BPE tokenizer trained here on a few sentences: nothing is downloaded, so any
machine with SGLang's environment can build them in a few seconds. The weights come from a seeded
generator, so the same seed gives the same files.

A model with Hugging Face's default random weights decodes greedily into one repeated token within a
few steps, and a stream of one repeated token hides a gap or a duplicate at a resume. So the weights
are random but shaped: the output projection maps each token's embedding onto the next token of one
random cycle through the whole vocabulary (`cycle_of`), with embeddings drawn large enough
(`EMBED_STD`) to dominate the layers' random contributions. Greedy output then walks the cycle, hundreds
of tokens without a repeat, with the layers' context-dependent noise still in every logit; the draft
model shares the cycle, so its drafts are mostly accepted. End-of-text is never the argmax (its output
row is zero), so streams run to their token limit. Runs in SGLang's environment (transformers,
tokenizers, torch); the gateway never imports it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 512
EMBED_STD = 0.5  # each token's embedding norm ~ EMBED_STD * sqrt(hidden); the layers add ~0.5-1
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "When a worker dies mid-generation, the stream continues elsewhere, token for token.",
    "Checkpoints of the KV cache stream to the host memory of another worker.",
    "Hello, world! Tell me a story about a lighthouse keeper and the sea.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a cluster of servers that never lost a request.",
]
# name -> (layers, hidden, intermediate, attention heads, kv heads, head dim)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "target": (2, 128, 256, 4, 2, 32),
    "draft": (1, 64, 128, 2, 1, 32),
}


def build_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(
    out: Path, shape: tuple[int, int, int, int, int, int], vocab: int, eos_id: int, seed: int
) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    layers, hidden, inter, heads, kv_heads, head_dim = shape
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed + 1 + layers * hidden)
    model = Qwen3ForCausalLM(cfg)
    nxt = cycle_of(vocab, eos_id, seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, EMBED_STD)
        unit = emb / emb.norm(dim=1, keepdim=True)
        head = model.lm_head.weight
        head.zero_()
        for tok, follower in enumerate(nxt):
            if follower >= 0:
                head[follower] = unit[tok]
    model.save_pretrained(out, safe_serialization=True)


def cycle_of(vocab: int, eos_id: int, seed: int) -> list[int]:
    """next[t]: the token that follows t on one random cycle through every token but end-of-text
    (next[eos] = -1). The same seed gives the same cycle to the target and the draft."""
    import torch

    g = torch.Generator().manual_seed(seed)
    order = [t for t in torch.randperm(vocab, generator=g).tolist() if t != eos_id]
    nxt = [-1] * vocab
    for i, t in enumerate(order):
        nxt[t] = order[(i + 1) % len(order)]
    return nxt


def build(out: Path, seed: int = 0) -> dict[str, Path]:
    """Write the target and the draft model under `out`; returns their directories."""
    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    for name, shape in SHAPES.items():
        d = out / name
        tok = build_tokenizer(d)
        build_model(d, shape, len(tok), tok.convert_tokens_to_ids(EOS), seed)
        made[name] = d
    (out / "lumen-tiny.json").write_text(json.dumps({"seed": seed, "shapes": SHAPES}, indent=1))
    return made


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m worker_hooks.sglang.tiny_model", description=__doc__.split("\n")[0]
    )
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name, d in build(a.out, a.seed).items():
        print(f"{name}: {d}")


if __name__ == "__main__":
    main()
