"""The fault vocabulary of local clusters' admin API (`POST /admin/workers/{id}/kill?mode=…`) and of
load-test fault schedules: what each mode does is the supervisor's business (gateway/cluster)."""

from __future__ import annotations

import signal

# kill: kill -9; hang: the whole process freezes (heartbeats stop); stall: only the engine loop
# freezes (heartbeats go on: a gray failure); resume / unstall undo them; term: graceful stop
SIGNAL_MODES = ("kill", "hang", "resume", "stall", "unstall", "term")
# slow: the engine keeps serving but every step takes `factor` x its modelled time (a degraded GPU;
# the gateway forwards it to the worker's `POST /lumen/fault`, no signal can carry a factor); normal
# undoes it. A worker restarted by the supervisor starts at normal speed.
SPEED_MODES = ("slow", "normal")
FAULT_MODES = (*SIGNAL_MODES, *SPEED_MODES)
# the modes that apply to an engine other than Lumen's own (an SGLang server): stall/unstall are
# Lumen-engine signals (SIGUSR1 would simply kill an SGLang server), and speed faults need Lumen's
# `/lumen/fault` endpoint
SERVER_SIGNAL_MODES = ("kill", "hang", "resume", "term")
SLOWDOWN_RANGE = (1.0, 1000.0)  # a factor below 1 would be a speed-up; far beyond, a stall models it

# each of SIGNAL_MODES as the signal that carries it to a local worker process (a test checks they agree)
FAULT_SIGNALS: dict[str, signal.Signals] = {
    "kill": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "resume": signal.SIGCONT,
    "stall": signal.SIGUSR1,
    "unstall": signal.SIGUSR2,
    "term": signal.SIGTERM,
}
