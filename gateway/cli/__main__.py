"""`python -m gateway.cli ARGS`: the `lumen` command."""

import sys

from gateway.cli import main

sys.exit(main())
