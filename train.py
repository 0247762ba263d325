"""Pre-train an MC-AR model: `python train.py model=700m` (= `mcar train`; conf/train.yaml has every option)."""
from mcar.tools.train import main

if __name__ == "__main__":
    main()
