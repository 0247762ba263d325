"""`python -m mcar.play`, kept for existing commands: the same as `mcar play` (mcar/tools/play.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["play", *sys.argv[1:]])
