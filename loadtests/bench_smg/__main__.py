"""`python -m loadtests.bench_smg`: see loadtests/bench_smg/cli.py."""

import sys

from loadtests.bench_smg.cli import main

sys.exit(main())
