"""Discrete-event simulator: a second shell around `gateway.core` on a virtual clock (DESIGN 2).

Public API (import from the submodules; this package imports nothing, so `lumen` starts fast, but
the native loader when LUMEN_SIM_NATIVE asks for it: see the end of this file):
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

import os as _os

# A simulator process may run its hot modules compiled (gateway/sim/native.py): the build must be
# found before anything imports them, so the switch is where the simulator starts, here, and the
# processes that set LUMEN_SIM_NATIVE import this package before any `gateway.core` module
# (native.LUMEN, scripts/bench_sim.py; `--jobs` children unpickle `gateway.sim.pool` first). The live
# gateway and the workers never import it.
if _os.environ.get("LUMEN_SIM_NATIVE"):
    from gateway.sim.native import activate as _activate

    _activate(_os.environ["LUMEN_SIM_NATIVE"])
