"""Functional core: pure policies shared by the live gateway and the simulator.

Nothing here does I/O, reads a clock, logs, or uses global randomness; time and state come in as
arguments and decisions go out as values.
"""
