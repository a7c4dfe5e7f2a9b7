"""The one error a bad configuration gets: it names the key, the value and the reason."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key, the value and why."""

    def __init__(self, key: str, value: object, why: str) -> None:
        super().__init__(f"config key '{key}' = {value!r}: {why}")
        self.key = key
        self.value = value
        self.why = why
