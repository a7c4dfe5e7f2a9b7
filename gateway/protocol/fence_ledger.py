"""The on-disk form of a gateway's fences (gateway/server/workers/fences.py): one JSON object per line.

A line says "incarnations up to `incarnation` of `worker` are fenced at this gateway". Readers skip a
line of another `v` (logged), so a newer gateway's file never makes an older one admit a fence away.
"""

from __future__ import annotations

import msgspec

FENCE_LEDGER_VERSION = 1


class FenceEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    worker: str
    incarnation: int
    at_unix_s: float  # when this gateway declared it (for people reading the file)
    v: int = FENCE_LEDGER_VERSION
