"""`python -m mcar.convert`, kept for existing commands: the same as `mcar convert` (mcar/tools/convert.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["convert", *sys.argv[1:]])
