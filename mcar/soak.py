"""`python -m mcar.soak`, kept for existing commands: the same as `mcar soak` (mcar/tools/soak.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["soak", *sys.argv[1:]])
