"""The torch model's weights: random, or safetensors in HF's layout (read, written, loaded, saved).

The architecture (`ModelConfig`, `PRESETS`) is in `torch_config`; the compute (`CausalLM`) in
`torch_model`, which this module builds models of.

A checkpoint is config.json plus `model.safetensors`, or shards listed by
`model.safetensors.index.json` (its `weight_map` names the file of every tensor). Reading validates
before it loads: every stored name must be expected (or explicitly skipped), every shape must match,
and every expected name must be present; each failure is a ValueError naming the tensor. Tensors are
opened straight on the target device (safetensors copies each one from the memory-mapped file; no
host-side state dict is built) and cast there.

Random weights are drawn on the CPU in float32, each tensor from its own generator seeded by
(seed, name): bit-identical on any machine for one torch version, and independent of which other
tensors are drawn, so a model truncated to its first layers (a self-draft) shares the full model's
values. Drawing runs on several threads (torch's CPU normal sampler is single-threaded). Scale:
matrices std 1/sqrt(fan_in), norm weights 1, embeddings std 1 — except when tied to the LM head,
where they are the LM head and get 1/sqrt(hidden) like it: an std-1 tied embedding makes the input
token's own logit (|e|² ≈ hidden) dwarf all others, and greedy decoding echoes its input forever.
Logits then have std ~1 and a top-1 margin of typically ~0.3; greedy decoding of "tiny" goes
through dozens of distinct ids before it cycles, so no further scaling is applied. Tied random models
(qwen3-0.6b) still fall into repeating a token after a few greedy steps (the echo is weakened, not
gone): they serve timing, not output variety.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.torch_config import PRESETS, ModelConfig
from models.torch_model import CausalLM

# -- checkpoint files -------------------------------------------------------------------------------
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint in `folder`, the index taking precedence."""
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    raise ValueError(f"{folder}: neither {SINGLE} nor {INDEX}")


def read_checkpoint(
    folder: Path,
    expected: Mapping[str, tuple[int, ...]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    skip: Callable[[str], bool] = lambda name: False,
) -> dict[str, torch.Tensor]:
    """Every tensor of `expected`, cast to `dtype` on `device`; names for which `skip` holds are ignored."""
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        if not path.is_file():
            raise ValueError(f"{path}: listed in the index but missing")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if skip(name):
                    continue
                if name not in expected:
                    if name.endswith(".bias"):
                        raise ValueError(f"{path.name}: bias tensor {name!r} (Qwen3/Llama have no biases)")
                    raise ValueError(f"{path.name}: unexpected tensor {name!r}")
                if name in out:
                    raise ValueError(f"{path.name}: tensor {name!r} stored twice")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ValueError(
                        f"{path.name}: tensor {name!r} has shape {shape}, expected {expected[name]}"
                    )
                out[name] = f.get_tensor(name).to(dtype)
    missing = [name for name in expected if name not in out]
    if missing:
        raise ValueError(f"{folder}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    return out


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor], folder: Path, *, shard_bytes: int | None = None
) -> list[Path]:
    """Write `tensors` (moved to host memory) as one file, or as shards of about `shard_bytes` with an index.

    Checkpoint files from an earlier write into the same folder are removed first, so a stale index
    can never shadow the new files.
    """
    if shard_bytes is not None and shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX]:
        stale.unlink(missing_ok=True)
    host = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    meta = {"format": "pt"}
    if shard_bytes is None:
        save_file(host, str(folder / SINGLE), metadata=meta)
        return [folder / SINGLE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in host.items():  # a shard closes when the next tensor would overflow it
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(folder / file), metadata=meta)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in host.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [folder / file for file in files]


def _draw(seed: int, name: str, shape: tuple[int, ...], tied: bool) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    t = torch.randn(shape, generator=torch.Generator().manual_seed(int.from_bytes(digest) >> 1))
    return t if name == "model.embed_tokens.weight" and not tied else t.mul_(1.0 / math.sqrt(shape[-1]))


def random_tensors(
    shapes: Mapping[str, tuple[int, ...]],
    seed: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    threads: int = 8,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names, tied = list(shapes), "lm_head.weight" not in shapes
    with ThreadPoolExecutor(threads) as pool:  # `threads` float32 tensors in flight at most
        for i in range(0, len(names), threads):
            chunk = names[i : i + threads]
            for name, t in zip(
                chunk, pool.map(lambda n: _draw(seed, n, shapes[n], tied), chunk), strict=True
            ):
                out[name] = t.to(dtype).to(device)
    return out


# -- weights ----------------------------------------------------------------------------------------
def _skeleton(cfg: ModelConfig) -> tuple[CausalLM, dict[str, tuple[int, ...]]]:
    """The model with storage-less (meta) parameters, and its HF tensor names and shapes."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return model, {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _materialize(model: CausalLM, tensors: dict[str, torch.Tensor]) -> CausalLM:
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def random_model(cfg: ModelConfig, seed: int, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> CausalLM:  # fmt: skip
    """Random weights, bit-identical for (cfg, seed) anywhere (see the module docstring for the scale)."""
    model, shapes = _skeleton(cfg)
    return _materialize(model, random_tensors(shapes, seed, dtype=dtype, device=torch.device(device)))


def _load(folder: Path, dtype: torch.dtype, device: str | torch.device, num_layers: int | None) -> CausalLM:
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json")
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    if num_layers is not None:
        cfg = cfg.truncated(num_layers)
    model, shapes = _skeleton(cfg)

    def skip(name: str) -> bool:  # tied checkpoints may still store lm_head; old Llama ones inv_freq
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return (
            (cfg.tie_word_embeddings and name == "lm_head.weight")
            or name.endswith(".rotary_emb.inv_freq")
            or (layer is not None and int(layer.group(1)) >= cfg.num_layers)
        )

    return _materialize(
        model, read_checkpoint(folder, shapes, dtype=dtype, device=torch.device(device), skip=skip)
    )


def load_model(folder: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> CausalLM:  # fmt: skip
    """A HuggingFace checkpoint folder: config.json plus model.safetensors or indexed shards."""
    return _load(Path(folder), dtype, device, None)


def save_model(model: CausalLM, folder: str | Path, *, shard_bytes: int | None = None) -> None:
    """config.json and safetensors with HF names (shards plus an index when shard_bytes is given)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = str(model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(
        json.dumps({**model.cfg.to_hf(), "torch_dtype": dtype}, indent=2) + "\n"
    )
    write_checkpoint(model.state_dict(), folder, shard_bytes=shard_bytes)


def load_or_init(name_or_path: str, seed: int, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", num_layers: int | None = None) -> CausalLM:  # fmt: skip
    """A preset with random weights, or a checkpoint folder; `num_layers` keeps only the first layers
    (with the final norm and LM head), e.g. a self-draft of the target."""
    if name_or_path in PRESETS:
        cfg = PRESETS[name_or_path]
        return random_model(
            cfg if num_layers is None else cfg.truncated(num_layers), seed, dtype=dtype, device=device
        )
    if not Path(name_or_path).is_dir():
        raise ValueError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a folder")
    return _load(Path(name_or_path), dtype, device, num_layers)
