"""Discrete-event simulator: a second shell around `gateway.core` on a virtual clock (DESIGN 2).

Public API (import from the submodules; this package imports nothing, so `lumen` starts fast):
- `scenario`: `Scenario`, `load_scenario(name_or_path)`, `parse_scenario(dict)`, `scenario_names()`
- `workload`: `Workload`, `synthetic(rng, rate, duration_s, cv)`, `read_trace(path)` (`TraceError`),
  `LengthFit`, `describe_trace` / `describe_synthetic` / `workload_label` (what a report ran)
- `simulation`: `Simulation(scenario, policy, workload, seed, failures).run() -> RunResult`
- `runner`: `run_scenario(scenario, modes, seed) -> ScenarioReport`, `build_workload`, `resolve_workload`,
  `with_overrides` (duration, rate, trace, speedup), `calibrate_rate`
- `calibrate`: `calibrate_speedup` (a trace's speedup for a target no-failure TTFT)
- `tuning`: `tune(scenario, Grid(...), seed) -> dict`
- `cli`: `lumen sim` and `lumen tune`
"""
