"""Lumen: a failure-transparent LLM serving gateway.

The namespace of the gateway's parts (docs/design.md §2); importing it runs nothing. The simulator's
native build is activated by the simulator package itself (gateway/sim/__init__.py).
"""

__version__ = "0.1.0"
