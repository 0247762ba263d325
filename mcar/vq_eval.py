"""`python -m mcar.vq_eval`, kept for existing commands: the same as `mcar vq_eval` (mcar/tools/vq_eval.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["vq_eval", *sys.argv[1:]])
