"""Post-train a model on its own rollouts (GRPO, rewards against the simulator):
`python posttrain.py init_from=checkpoints/shipped/crafter_world` (= `mcar posttrain`)."""
from mcar.tools.posttrain import main

if __name__ == "__main__":
    main()
