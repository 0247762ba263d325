"""`python -m mcar.vq_train`, kept for existing commands: the same as `mcar vq_train` (mcar/tools/vq_train.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["vq_train", *sys.argv[1:]])
