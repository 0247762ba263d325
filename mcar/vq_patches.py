"""`python -m mcar.vq_patches`, kept for existing commands: the same as `mcar vq_patches` (mcar/tools/vq_patches.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["vq_patches", *sys.argv[1:]])
