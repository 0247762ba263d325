"""`python -m mcar.vq_train`: the command line of `mcar.train.vq`."""
from mcar.train.vq import main

if __name__ == "__main__":
    main()
