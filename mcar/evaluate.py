"""`python -m mcar.evaluate`: the command line of `mcar.eval.evaluate`, run as `__main__` so that Hydra finds
conf/ by file path (from a module path it would look for an importable `conf` package)."""
import runpy

if __name__ == "__main__":
    runpy.run_module("mcar.eval.evaluate", run_name="__main__", alter_sys=True)
