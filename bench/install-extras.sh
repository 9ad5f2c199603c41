#!/usr/bin/env bash
# Bench-only extras for bench/train.py: TorchRec + fbgemm's CPU build.
#
# Never `pip install torchrec` plainly: it resolves fbgemm-gpu (CUDA) and may
# replace the CPU torch. --no-deps plus a torch constraint keeps torch==2.13.0.
set -euo pipefail
pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 -c <(echo torch==2.13.0)
pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath -c <(echo torch==2.13.0)
