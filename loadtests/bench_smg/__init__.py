"""Gateway overhead side by side: workers direct, through Lumen, through SMG (`python -m loadtests.bench_smg`).

- cli.py: the flags, the JSON report and the tables written beside it;
- measure.py: the cluster and SMG, every path at every rate, CPU accounting, the per-path rows;
- drive.py: the open-loop request mix and the clients of each path;
- smg_process.py: SMG found or installed, launched in front of the workers, probed;
- report.py: the Markdown tables;
- plots.py: the PNG (achieved rate and TTFT p99 per path and offered rate).
"""

from loadtests.bench_smg.cli import main

__all__ = ["main"]
