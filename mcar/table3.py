"""`python -m mcar.table3`: the command line of `mcar.eval.table3`."""
from mcar.eval.table3 import main

if __name__ == "__main__":
    main()
