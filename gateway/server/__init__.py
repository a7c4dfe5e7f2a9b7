"""Imperative shell of the gateway: HTTP API, control plane, sessions, recovery, config, metrics."""
