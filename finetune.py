"""Fine-tune a pre-trained model: `python finetune.py mask=diagd steps=1000 [init_from=path/to.ckpt]`
(= `mcar finetune`)."""
from mcar.tools.finetune import main

if __name__ == "__main__":
    main()
