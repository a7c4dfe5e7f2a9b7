"""Recovery modes and ablations as data (DESIGN 6, EVALUATION "Modes").

Every mode is one `RecoveryPolicy`: which of Lumen's mechanisms are on, and which placement and
dispatch rule the checkpoint manager and recovery coordinator use. The live gateway and the simulator
look a mode up here by name, so a table row means the same thing in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from gateway.core.types import check


class Placement(StrEnum):
    """Where checkpoints go: least estimated load (Algorithm 1) or the next worker by id (DéjàVu)."""

    LOAD_AWARE = "load_aware"
    RING = "ring"


class DispatchRule(StrEnum):
    """How an interrupted request is resumed (Algorithm 2 and its alternatives, see dispatch.py)."""

    THRESHOLD = "threshold"
    COST = "cost"
    ALWAYS_HOLDER = "always_holder"
    REPLAY = "replay"


PLACEMENTS: tuple[str, ...] = tuple(Placement)
DISPATCH_RULES: tuple[str, ...] = tuple(DispatchRule)


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    """What the gateway does about worker failures in one mode.

    `failover` False means an interrupted request ends with an error to its client (what the SGLang
    gateway does); every other field is then irrelevant. `dispatch` is only consulted when
    `failover` is on; `placement` only when `checkpointing` is on. `outage_admission`: the serving
    workers admit a larger batch while a recovery lasts (core/outage.py `outage_boost`), a Lumen
    lever the baselines as published do not have.
    """

    name: str
    failover: bool
    checkpointing: bool
    placement: Placement
    dispatch: DispatchRule
    draft_assist: bool
    outage_admission: bool = False

    def __post_init__(self) -> None:
        check(
            self.placement in PLACEMENTS,
            "placement",
            self.placement,
            f"must be one of {', '.join(PLACEMENTS)}",
        )
        check(
            self.dispatch in DISPATCH_RULES,
            "dispatch",
            self.dispatch,
            f"must be one of {', '.join(DISPATCH_RULES)}",
        )
        if self.checkpointing and self.dispatch == "replay":
            # checkpoints nobody restores are pure overhead: a mode that writes them must read them
            raise ValueError(f"mode {self.name!r}: checkpointing with dispatch 'replay' restores nothing")


def _mode(
    name: str,
    *,
    failover: bool = True,
    checkpointing: bool = True,
    placement: Placement = Placement.LOAD_AWARE,
    dispatch: DispatchRule = DispatchRule.THRESHOLD,
    draft_assist: bool = True,
    outage_admission: bool = True,
) -> RecoveryPolicy:
    return RecoveryPolicy(name, failover, checkpointing, placement, dispatch, draft_assist, outage_admission)


_ALL = (
    # the client sees the failure (SGLang model gateway)
    _mode(
        "none",
        failover=False,
        checkpointing=False,
        dispatch=DispatchRule.REPLAY,
        draft_assist=False,
        outage_admission=False,
    ),
    # replay prompt + emitted ids on the least-loaded survivor (Dynamo's migration)
    _mode(
        "stop_restart",
        checkpointing=False,
        dispatch=DispatchRule.REPLAY,
        draft_assist=False,
        outage_admission=False,
    ),
    # DéjàVu: the holder is the next worker by id and a request always resumes there
    _mode(
        "fixed_checkpoint",
        placement=Placement.RING,
        dispatch=DispatchRule.ALWAYS_HOLDER,
        draft_assist=False,
        outage_admission=False,
    ),
    # all three mechanisms, the paper's threshold rule
    _mode("lumen"),
    _mode("lumen-no-draft", draft_assist=False),
    _mode("lumen-fixed-placement", placement=Placement.RING),
    _mode("lumen-always-holder", dispatch=DispatchRule.ALWAYS_HOLDER),
    # Lumen's own improvement: the cost-model dispatch rule instead of the threshold rule
    _mode("lumen-cost", dispatch=DispatchRule.COST),
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
