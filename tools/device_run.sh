#!/usr/bin/env bash
# One call on the device machine: install, GPU tests, demo (and later the benchmark).
# Usage (on the device): bash tools/device_run.sh [pytest -k expression]
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv | tee "$OUT/env.txt"
python -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/env.txt"
python -m pytest tests -m "gpu or multigpu" -q -x ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest-gpu.log"
