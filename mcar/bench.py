"""`python -m mcar.bench`, kept for existing commands: the same as `mcar bench` (mcar/tools/bench.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
