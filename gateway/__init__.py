"""Lumen: a failure-transparent LLM serving gateway."""

__version__ = "0.1.0"
