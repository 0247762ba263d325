"""`python -m mcar.evaluate`, kept for existing commands: the same as `mcar evaluate` (mcar/tools/evaluate.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["evaluate", *sys.argv[1:]])
