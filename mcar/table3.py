"""`python -m mcar.table3`, kept for existing commands: the same as `mcar table3` (mcar/tools/table3.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["table3", *sys.argv[1:]])
