"""Lumen: a failure-transparent LLM serving gateway."""

import os as _os

__version__ = "0.1.0"

# A simulator process may run its hot modules compiled (gateway/sim/native.py): they must be found
# in the build before anything imports them, so the switch is here. The live gateway never sets it.
if _os.environ.get("LUMEN_SIM_NATIVE"):
    from gateway.sim.native import activate as _activate

    _activate(_os.environ["LUMEN_SIM_NATIVE"])
