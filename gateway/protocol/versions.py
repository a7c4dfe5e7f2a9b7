"""Protocol versions, one per plane. A peer speaking another version is refused and logged."""

from typing import Final

CONTROL_PROTOCOL_VERSION: Final = 2  # control.proto, package lumen.control.v1 (2: plane keys, Members)
GENERATE_PROTOCOL_VERSION: Final = 1  # the `lumen` extension of /generate
KV_PROTOCOL_VERSION: Final = 1  # checkpoint plane (ZMQ)
DRAFT_PROTOCOL_VERSION: Final = 1  # draft-assist plane (ZMQ)
