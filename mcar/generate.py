"""`python -m mcar.generate`, kept for existing commands: the same as `mcar generate` (mcar/tools/generate.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["generate", *sys.argv[1:]])
