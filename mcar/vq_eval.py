"""`python -m mcar.vq_eval`: the command line of `mcar.eval.vq`."""
from mcar.eval.vq import main

if __name__ == "__main__":
    main()
