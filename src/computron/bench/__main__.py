"""``python -m computron.bench round-robin|swap ...``: the engine benchmarks without the rest of the CLI."""

import argparse
import sys

from . import round_robin, swap

parser = argparse.ArgumentParser(prog="python -m computron.bench")
sub = parser.add_subparsers(dest="bench", required=True)
round_robin.add_parser(sub)
swap.add_parser(sub)
args = parser.parse_args()
sys.exit(int(args.func(args) or 0))
