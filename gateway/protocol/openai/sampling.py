"""SGLang-native `sampling_params` (/generate), checked as strictly as the OpenAI bodies.

SGLang itself refuses a key its `SamplingParams` does not define. Here every key is one of three:

- honoured by the server: read and range-checked (the gateway honours `HONOURED_BY_GATEWAY`, Lumen's
  worker `HONOURED_BY_WORKER`: it gets stop strings matched and seeds drawn by the gateway);
- defined by SGLang but not honoured: accepted only at its neutral value (SGLang's default, or null),
  else 400 `unsupported_parameter` (SGLang clients and gateways such as SMG send the defaults);
- anything else: 400 `unknown_parameter`.

Each refusal is an InvalidRequest naming `sampling_params.<key>`. The gateway's /generate and the
worker's /generate both parse through requests.parse_sampling_params, which calls `check_keys`.
"""

from __future__ import annotations

from collections.abc import Collection

from gateway.protocol.openai.fields import UNKNOWN, UNSUPPORTED, Fields, is_number

HONOURED_BY_GATEWAY = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
    }
)
HONOURED_BY_WORKER = HONOURED_BY_GATEWAY - {"stop", "sampling_seed"}

# SGLang's other sampling parameters (srt/sampling/sampling_params.py, 0.5.x) and their neutral values;
# a key honoured by neither side but listed here is accepted at one of these values (or null)
NEUTRAL: dict[str, tuple[object, ...]] = {
    "stop": ("", []),
    "sampling_seed": (),
    "stop_regex": ("", []),
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_new_tokens": (0,),
    "n": (1,),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "no_stop_trim": (False,),
    "stream_interval": (),
    "logit_bias": ({},),
    "custom_params": (),
    "beam_width": (),
    "watermark": (),
    "choice": ([],),
}


def is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """`value` is null or one of `neutral` (numbers compare by value, other values by value and type)."""
    if value is None:
        return True
    for n in neutral:
        if is_number(n) and is_number(value):
            if value == n:
                return True
        elif type(value) is type(n) and value == n:
            return True
    return False


def check_keys(sp: Fields, honoured: Collection[str]) -> None:
    """Refuse a key of `sp` that is unknown, or known to SGLang but not honoured here and not neutral."""
    for key, value in sp.items():
        if key in honoured:
            continue
        if key not in NEUTRAL:
            raise sp.fail(key, "is not a sampling parameter", UNKNOWN)
        if not is_neutral(value, NEUTRAL[key]):
            allowed = ", ".join(repr(n) for n in (None, *NEUTRAL[key]))
            raise sp.fail(key, f"is not supported here (only {allowed})", UNSUPPORTED)
