"""A launcher check without JAX: prints to stdout and stderr, exits as told.

Usage: ``echo.py [--marker DIR] [--fail-rank R] [--code C | --signal NAME]``.
With ``--marker`` every process first creates ``DIR/p<rank>``. Process R then
exits with code C, or kills itself with signal NAME; the others exit with 0.
"""

import argparse
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--marker")
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--code", type=int, default=0)
parser.add_argument("--signal")
ns = parser.parse_args()

rank = int(os.environ["SKIPREDUCE_PROCESS_ID"])
if ns.marker:
    open(os.path.join(ns.marker, f"p{rank}"), "w").close()
keys = (
    "SKIPREDUCE_COORDINATOR",
    "SKIPREDUCE_NUM_PROCESSES",
    "SKIPREDUCE_LOCAL_DEVICES",
    "JAX_PLATFORMS",
    "SKIPREDUCE_GLOO_INTERFACE",
    "no_proxy",
)
print("env " + " ".join(f"{k}={os.environ.get(k)}" for k in keys))
print(f"stdout line from {rank}")
print(f"stderr line from {rank}", file=sys.stderr)
sys.stdout.write(f"last line from {rank} without newline")
sys.stdout.flush()
if rank == ns.fail_rank:
    if ns.signal:
        os.kill(os.getpid(), signal.Signals[ns.signal])
    sys.exit(ns.code)
