"""Chaos across hosts: Lumen's processes in network namespaces, network and process faults, a checker."""
