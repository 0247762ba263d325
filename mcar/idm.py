"""`python -m mcar.idm`, kept for existing commands: the same as `mcar idm` (mcar/tools/idm.py)."""
import sys

from mcar.cli import main

if __name__ == "__main__":
    main(["idm", *sys.argv[1:]])
