#!/usr/bin/env bash
# Builds an offline wheelhouse of what mcar needs beyond a CUDA PyTorch image that has torch and lightning (numpy,
# einops, pillow, safetensors, tqdm, rich, imageio, torchmetrics are assumed present: a CUDA PyTorch image has them),
# for a machine with no package index.
#   bash scripts/wheelhouse.sh DIR            # minimal: hydra-core, omegaconf, antlr4 4.9.3, diffusers (~7 MB)
#   bash scripts/wheelhouse.sh DIR --full     # also wandb, av, crafter: ~65 MB in all
# PYTHON_VERSION (default 3.12) is the GPU machine's Python, not this one's. Install there, with no network:
#   python3 -m pip install -q --no-index --no-deps --target "$PWD/.site" DIR/*.whl && export PYTHONPATH="$PWD/.site"
# (or `bash scripts/gpu_check.sh --wheels DIR`) and run with data=synthetic logger=csv unless --full was built.
set -euo pipefail
dir=${1:?usage: wheelhouse.sh DIR [--full]}; full=${2:-}
py=${PYTHON_VERSION:-3.12}
mkdir -p "$dir"
plat=(--only-binary=:all: --python-version "$py" --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# antlr4 4.9.3 (what omegaconf 2.3 pins) is published as source only: build its pure-python wheel here
python3 -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" hydra-core==1.3.8 omegaconf==2.3.1 diffusers==0.42.1 \
  importlib_metadata zipp
if [ "$full" = --full ]; then
  python3 -m pip wheel -q --no-deps -w "$dir" crafter==1.8.3
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" wandb==0.31.0 av opensimplex ruamel.yaml \
    sentry-sdk platformdirs gitpython gitdb smmap setproctitle pydantic pydantic_core annotated_types typing_inspection
fi
ls "$dir"; du -sh "$dir"
