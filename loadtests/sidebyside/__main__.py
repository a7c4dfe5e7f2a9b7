"""`python -m loadtests.sidebyside`: see loadtests/sidebyside/cli.py."""

import sys

from loadtests.sidebyside.cli import main

sys.exit(main())
