"""`python -m mcar.vq_train`: the command line of `mcar.train.vq`, run as `__main__` so that Hydra finds
conf/ by file path (from a module path it would look for an importable `conf` package)."""
import runpy

if __name__ == "__main__":
    runpy.run_module("mcar.train.vq", run_name="__main__", alter_sys=True)
