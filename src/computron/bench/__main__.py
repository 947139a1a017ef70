"""``python -m computron.bench round-robin|swap ...``: the engine benchmarks without the rest of the CLI."""

import argparse
import sys

from .cli import add_parsers

parser = argparse.ArgumentParser(prog="python -m computron.bench")
sub = parser.add_subparsers(dest="bench", required=True)
add_parsers(sub)
args = parser.parse_args()
sys.exit(int(args.func(args) or 0))
