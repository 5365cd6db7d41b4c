#!/usr/bin/env bash
# One call on the device machine: install, then the steps named in $STEPS (default: all):
#   tests  GPU tests (pytest -m "gpu or multigpu"; $K narrows with -k)
#   demo   epgen demo (deepseek-v3, 8 virtual ranks)
#   bench  epgen bench W=2 (two GPUs), full sweep, CSV/PNG under tools/results and $OUT
#   sweep  geometry exploration at 128/4096/8192 tokens ($GEOS: "DISPATCHxW..:COMBINE..." pairs)
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests demo bench}
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv | tee "$OUT/env.txt"
python -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/env.txt"
for step in $STEPS; do
  echo "=== $step"
  case $step in
    tests) python -m pytest tests -m "gpu or multigpu" -q -x ${K:+-k "$K"} 2>&1 | tee "$OUT/pytest-gpu.log" ;;
    demo) python -m epgen demo 2>&1 | tee "$OUT/demo.log" ;;
    bench) python -m epgen bench --world-size 2 -o tools/results/bench-ep2-h200 2>&1 | tee "$OUT/bench.log"
           cp tools/results/bench-ep2-h200.* "$OUT/" ;;
    sweep) for g in ${GEOS:-24x16u4:24x16u4}; do
             python -m epgen bench --world-size 2 --tokens 128 4096 8192 --routing uniform \
               --dispatch-geometry "${g%%:*}" --combine-geometry "${g##*:}" -o "/tmp/sweep-$g" 2>&1 | grep -E "dispatch|combine" | tee -a "$OUT/sweep.log"
           done ;;
  esac
done
