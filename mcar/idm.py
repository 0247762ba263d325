"""`python -m mcar.idm`: the command line of `mcar.eval.idm`."""
from mcar.eval.idm import main

if __name__ == "__main__":
    main()
