"""Does a server promise bit-equal replays? Determinism said, not assumed (issue 27).

Replay failover resumes a request elsewhere with `prompt + emitted` as its input. That continuation is
always coherent (exactly the tokens the client has, no duplicate, no gap); it equals the uninterrupted
run only when the new server's logits at each position are bit-equal to the dead one's decode steps,
and, for sampled requests, when both sample position p from the same seed.

For an SGLang server (sglang 0.5.23) that depends on how it was launched, which its `GET /server_info`
answers (`gateway/server/workers/server_info.py`):

- **bit-equal logits** are promised only with `--enable-deterministic-inference` and a deterministic
  attention backend (`DETERMINISTIC_ATTENTION_BACKENDS`, SGLang's
  `srt/arg_groups/choices.py DETERMINISTIC_ATTENTION_BACKEND_CHOICES`; SGLang sets the sampling backend to
  `pytorch` itself then): batch-invariant kernels, so a replay's prefill of prompt + emitted ids gives the
  logits the dead server's decode steps gave;
- **`sampling_seed`** is used only under deterministic inference
  (`srt/sampling/sampling_batch_info.py`: without it the seed is not even read), so a seeded replay
  samples the same tokens only there;
- without deterministic inference, logits depend on batch shape and kernel order: on GPUs in bf16 or
  fp16 a replay may diverge right after the resume point; on CPU (`--device cpu`, torch-native
  attention) float32 replays were exact in practice (issue 27: every greedy stream of a kill -9 test),
  bf16 ones were not (4–5 of 6 diverged). "Exact in practice" is not a promise.

Lumen's own workers sample position p with RNG(seed_base, p) and are exact for greedy and seeded
requests by construction (`LUMEN_WORKER`).

Pure: the shells read the facts (`Numerics`) and ask `judge_numerics`; `seed_ignored_by` says which
live servers would make a sampled request's replay irreproducible.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DETERMINISTIC_ATTENTION_BACKENDS",
    "LUMEN_WORKER",
    "UNKNOWN",
    "Determinism",
    "Numerics",
    "judge_numerics",
    "nonexact_sides",
    "seed_ignored_by",
]

# attention backends SGLang 0.5.23 accepts with --enable-deterministic-inference
DETERMINISTIC_ATTENTION_BACKENDS = frozenset({"ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton"})


@dataclass(frozen=True, slots=True)
class Numerics:
    """What a server computes with, as it reports it (SGLang's resolved launch arguments)."""

    dtype: str = "auto"
    attention_backend: str = ""
    sampling_backend: str = ""
    deterministic_inference: bool = False
    device: str = ""


@dataclass(frozen=True, slots=True)
class Determinism:
    """The judgement: `bit_equal`, a replay's logits equal the original's (promised); `seeded`, the
    server samples position p from the request's seed (a sampled replay repeats the tokens); `note`,
    why, for people (/admin/workers, `lumen cluster status`, logs)."""

    bit_equal: bool
    seeded: bool
    note: str

    @property
    def label(self) -> str:
        """One word for tables: exact (both promised), greedy-exact, or not-promised."""
        if self.bit_equal and self.seeded:
            return "exact"
        return "greedy-exact" if self.bit_equal else "not-promised"


LUMEN_WORKER = Determinism(True, True, "Lumen worker: seeded sampling, replays exact by construction")
UNKNOWN = Determinism(False, False, "not known (/server_info not read)")


def judge_numerics(n: Numerics) -> Determinism:
    """Whether a server with these numerics promises bit-equal replays (module docstring)."""
    where = f"{n.dtype or 'auto'} on {n.device or '?'} ({n.attention_backend or '?'} attention, " + (
        f"{n.sampling_backend or '?'} sampling)"
    )
    if n.deterministic_inference:
        if n.attention_backend in DETERMINISTIC_ATTENTION_BACKENDS:
            return Determinism(True, True, f"deterministic inference, {where}: bit-equal replays")
        return Determinism(
            False,
            True,
            f"deterministic inference with a backend not known to be batch-invariant, {where}: "
            "sampling_seed honoured, logits not promised bit-equal",
        )
    if n.device == "cpu" and n.dtype == "float32":
        return Determinism(
            False,
            False,
            f"{where}, no deterministic inference: greedy replays exact in practice (not promised), "
            "sampling_seed ignored",
        )
    return Determinism(
        False,
        False,
        f"{where}, no deterministic inference: a replay may diverge after the resume point, "
        "sampling_seed ignored",
    )


def seed_ignored_by(judged: Iterable[tuple[str, Determinism]]) -> list[str]:
    """The servers (by id) among `judged` that ignore `sampling_seed`: a sampled request's replay on
    any of them does not repeat the tokens the first run sampled."""
    return sorted(wid for wid, d in judged if not d.seeded)


def nonexact_sides(off: Determinism, onto: Determinism) -> tuple[str, ...]:
    """Which ends of a resume (the server it moves off, the one it moves onto) do not promise
    bit-equal logits: such a resume continues exactly the tokens the client has, but the continuation
    is not guaranteed to equal an uninterrupted run's. Empty: the resume is exact."""
    return tuple(side for side, d in (("off", off), ("onto", onto)) if not d.bit_equal)
