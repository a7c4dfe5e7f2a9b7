"""Recovery modes and ablations as data (DESIGN 6, EVALUATION "Modes").

Every mode is one `RecoveryPolicy`: which of Lumen's mechanisms are on, and which placement and
dispatch rule the checkpoint manager and recovery coordinator use. The live gateway and the simulator
look a mode up here by name, so a table row means the same thing in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

# where checkpoints go: least estimated load (Algorithm 1) or the next worker by id (DéjàVu)
Placement = Literal["load_aware", "ring"]
# how an interrupted request is resumed (Algorithm 2 and its alternatives, see dispatch.py)
DispatchRule = Literal["threshold", "cost", "always_holder", "replay"]

PLACEMENTS: tuple[str, ...] = get_args(Placement)
DISPATCH_RULES: tuple[str, ...] = get_args(DispatchRule)


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    """What the gateway does about worker failures in one mode.

    `failover` False means an interrupted request ends with an error to its client (what the SGLang
    gateway does); every other field is then irrelevant. `dispatch` is only consulted when
    `failover` is on; `placement` only when `checkpointing` is on.
    """

    name: str
    failover: bool
    checkpointing: bool
    placement: Placement
    dispatch: DispatchRule
    draft_assist: bool

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.dispatch not in DISPATCH_RULES:
            raise ValueError(f"dispatch must be one of {DISPATCH_RULES}, got {self.dispatch!r}")
        if self.checkpointing and self.dispatch == "replay":
            # checkpoints nobody restores are pure overhead: a mode that writes them must read them
            raise ValueError(f"mode {self.name!r}: checkpointing with dispatch 'replay' restores nothing")


def _mode(
    name: str,
    *,
    failover: bool = True,
    checkpointing: bool = True,
    placement: Placement = "load_aware",
    dispatch: DispatchRule = "threshold",
    draft_assist: bool = True,
) -> RecoveryPolicy:
    return RecoveryPolicy(name, failover, checkpointing, placement, dispatch, draft_assist)


_ALL = (
    # the client sees the failure (SGLang model gateway)
    _mode("none", failover=False, checkpointing=False, dispatch="replay", draft_assist=False),
    # replay prompt + emitted ids on the least-loaded survivor (Dynamo's migration)
    _mode("stop_restart", checkpointing=False, dispatch="replay", draft_assist=False),
    # DéjàVu: the holder is the next worker by id and a request always resumes there
    _mode("fixed_checkpoint", placement="ring", dispatch="always_holder", draft_assist=False),
    # all three mechanisms, the paper's threshold rule
    _mode("lumen"),
    _mode("lumen-no-draft", draft_assist=False),
    _mode("lumen-fixed-placement", placement="ring"),
    _mode("lumen-always-holder", dispatch="always_holder"),
    # Lumen's own improvement: the cost-model dispatch rule instead of the threshold rule
    _mode("lumen-cost", dispatch="cost"),
)

MODES: Mapping[str, RecoveryPolicy] = MappingProxyType({p.name: p for p in _ALL})

# the rows of every recovery table, in the order EVALUATION.md lists them
EVALUATION_MODES: tuple[str, ...] = (
    "none",
    "stop_restart",
    "fixed_checkpoint",
    "lumen",
    "lumen-no-draft",
    "lumen-fixed-placement",
    "lumen-always-holder",
)


def policy_for(name: str) -> RecoveryPolicy:
    """The policy of mode `name`; an unknown name raises ValueError listing the known ones."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown recovery mode {name!r}; known modes: {', '.join(MODES)}") from None
