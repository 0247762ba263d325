"""`python -m mcar.evaluate`: the command line of `mcar.eval.evaluate`."""
from mcar.eval.evaluate import main

if __name__ == "__main__":
    main()
