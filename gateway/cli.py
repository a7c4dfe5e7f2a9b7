"""`lumen` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lumen", description="Lumen gateway and tools")
    parser.add_subparsers(dest="cmd")
    args = parser.parse_args(argv)
    if not args.cmd:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
