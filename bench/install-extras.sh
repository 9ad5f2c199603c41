#!/usr/bin/env bash
# Bench-only extras: TorchRec + fbgemm's CPU build (bench/train.py, bench/quality.py),
# deepctr-torch + scikit-learn (bench/quality.py's DeepFM reference).
#
# Never `pip install torchrec` plainly: it resolves fbgemm-gpu (CUDA) and may
# replace the CPU torch. --no-deps plus a torch constraint keeps torch==2.13.0.
# deepctr-torch 0.3.0 asks for torch>=2.4 (pip may pick another build): --no-deps,
# and its own imports (scikit-learn, tqdm) installed beside it.
set -euo pipefail
pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 -c <(echo torch==2.13.0)
pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath -c <(echo torch==2.13.0)
pip install --no-deps deepctr-torch==0.3.0
pip install scikit-learn -c <(echo torch==2.13.0)
# bench/serve.py's HTTP load generator (a Debian package).
if ! command -v hey >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hey
fi
