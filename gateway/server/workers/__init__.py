"""The workers as the gateway sees them: the control-plane service (attach, heartbeats, commands),
the load monitor (states, failure detection, the live ClusterView) and the data-path client (/generate)."""
