"""Side-by-side live runs of the recovery modes (`python -m loadtests.sidebyside`, `lumen loadtest`).

- cli.py: the flags, the run per mode (and its no-failure reference), the summary rows;
- drive.py: the workload, the fault schedule, one fresh cluster per run driven and polled;
- report.py: per-mode metrics and summary.json, summary.md, timelines.json;
- plots.py: timeline.png and queues-MODE.png (optional: only with matplotlib).
"""

from loadtests.sidebyside.cli import main

__all__ = ["main"]
