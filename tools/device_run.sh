#!/usr/bin/env bash
# One call on the device machine: install, then the steps named in $STEPS, in order:
#   demo    epgen demo (deepseek-v3, 8 virtual ranks)
#   tune    epgen tune W=2 (two GPUs): writes codegen/tuning/sm_90.json
#   tunell  epgen tune W=1 (both families: the W=1 buckets, the low-latency geometry and threshold),
#           then the low-latency family alone on 2 virtual ranks (W=2's dispatch_ll/combine_ll entries from
#           one GPU; --family low_latency leaves the W=2 normal buckets measured on two GPUs alone)
#   latency tools/latency.py -> tools/results/latency-h200*
#   bench   epgen bench W=2 with the tuning table, uniform routing, tokens $BENCH_TOKENS (default the
#           full sweep) -> tools/results/bench-ep2-h200-tuned.{csv,png,env.txt}
#   bench24 the full sweep at 24 blocks x 32 warps (at most 24 SMs), 20 replays a point, uniform and
#           skewed routing -> tools/results/bench-ep2-h200.{csv,png,env.txt}
#   fp8     the fp8 dispatch beside it (24 x 32, uniform, tokens $BENCH_TOKENS) -> bench-ep2-h200-fp8.*
#   pull    bench24's sweep with the pull dispatch (--transport pull, uniform and skewed) -> bench-ep2-h200-pull.*
#   sweep   geometry exploration at 128/4096/8192 tokens ($GEOS: "DISPATCH:COMBINE" pairs)
#   tests   GPU tests (pytest -m "gpu or processes" over $TESTS, default every tests/ file; $K narrows with -k):
#           the processes-marked ones run W = 2, 3, 4 processes, all on cuda:0 when there are fewer GPUs
#   residency tools/residency_probe.py: a cooperative launch beside a kernel holding the GPU, in a graph,
#           its launch cost, and the start of W processes sharing cuda:0
#   small   epgen bench W=1 and virtual W=2 at 1, 128, 4096 tokens, uniform, 50 queued replays a
#           point -> tools/results/$SMALL_TAG-w{1,2}.{csv,png} (the before/after of the spin-waits)
#   stress  epgen stress: 200 rounds as W=2 and W=4 processes (sharing cuda:0 on one GPU; qwen3-30b-a3b, up to
#           $STRESS_TOKENS tokens, default 4096, the fp8_blockwise wire, a recoverable fault every 25 rounds), then
#           200 with 8 virtual ranks
#   probe   tools/p2p_probe.py: copy mechanisms (LSU vs bulk copies) at 16-132 blocks, both directions
#   moe     epgen demo --moe (deepseek-v3 MoE layer, 8 virtual ranks, $MOE_TOKENS tokens a rank, default
#           the demo's), then at W = 1 -> tools/results/moe-demo-h200-w{8,1}.txt
#   moebench tools/bench_moe.py at W = 1 (a one-rank NCCL group: correctness) -> tools/results/bench_moe-ep1-*
#   qprofile tools/quant_profile.py: the quantized combine's kernels alone, ablations, geometry sweeps
#           ($QPROFILE_ARGS, default --sweep) -> tools/results/quant-profile-h200.csv
#   qtune   epgen tune W=2 virtual, --family normal --quant <wire> for each wire of $QTUNE_WIRES (default all three): the
#           quantized combine's own entries in codegen/tuning/sm_90.json (from one GPU's local memory)
#   qbench  epgen bench W=2 virtual for each combine wire (none, fp8_blockwise, fp4_blockwise), uniform,
#           tokens $QBENCH_TOKENS (default 128 1024 4096 8192) -> tools/results/bench-ep2v-h200-<wire>.*
#   build   epgen build W=2 Tmax=8192 for sm_90 into a fresh cache, then time load_kernel per variant:
#           warm import from it against a cold compile (fresh processes, empty CUPY_CACHE_DIR, 5 runs)
#           -> tools/results/aot-import-ep2-h200.txt
# Everything it prints goes to $OUT/run.log; results and tables come back in $OUT/results.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" tools/results
exec > >(tee -a "$OUT/run.log") 2>&1
python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv
python -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'gpus', torch.cuda.device_count())"
for step in ${STEPS:-demo tune bench bench24 fp8 tests}; do
  echo "=== $step $(date -u +%T)"
  case $step in
    demo) python -m epgen demo ;;
    tune) python -m epgen tune --world-size 2 ;;
    tunell) timeout ${TUNE_TIMEOUT:-450} python -m epgen tune --world-size 1
            timeout ${TUNE_TIMEOUT:-450} python -m epgen tune --world-size 2 --virtual --family low_latency ;;
    latency) timeout ${LATENCY_TIMEOUT:-400} python tools/latency.py -o tools/results/latency-h200 ;;
    bench) timeout ${BENCH_TIMEOUT:-400} python -m epgen bench --world-size 2 --routing uniform \
             ${BENCH_TOKENS:+--tokens $BENCH_TOKENS} -o tools/results/bench-ep2-h200-tuned ;;
    bench24) timeout ${BENCH_TIMEOUT:-400} python -m epgen bench --world-size 2 --iters 20 \
               --dispatch-geometry 24x32u4 --combine-geometry 24x32u4 -o tools/results/bench-ep2-h200 ;;
    fp8) timeout ${BENCH_TIMEOUT:-400} python -m epgen bench --world-size 2 --iters 20 --dtype fp8 --routing uniform \
           ${BENCH_TOKENS:+--tokens $BENCH_TOKENS} --dispatch-geometry 24x32u4 --combine-geometry 24x32u4 \
           -o tools/results/bench-ep2-h200-fp8 ;;
    pull) timeout ${BENCH_TIMEOUT:-400} python -m epgen bench --world-size 2 --iters 20 --transport pull \
            --family normal --dispatch-geometry 24x32u4 --combine-geometry 24x32u4 -o tools/results/bench-ep2-h200-pull ;;
    sweep) for g in ${GEOS:-24x32u4:24x32u4}; do
             python -m epgen bench --world-size 2 --tokens 128 4096 8192 --routing uniform \
               --dispatch-geometry "${g%%:*}" --combine-geometry "${g##*:}" -o "/tmp/sweep-$g" | grep -E "dispatch|combine"
           done ;;
    stress) for w in 2 4; do
              timeout ${STRESS_TIMEOUT:-400} python -m epgen stress --world-size $w --model qwen3-30b-a3b \
                --max-tokens ${STRESS_TOKENS:-4096} --quant fp8_blockwise --rounds 200 --fault-every 25 | tail -3
            done
            timeout ${STRESS_TIMEOUT:-400} python -m epgen stress --world-size 8 --virtual --rounds 200 \
              --max-tokens ${STRESS_TOKENS_W8:-1024} | tail -3 ;;
    build) rm -rf /tmp/epgen-aot
           python -m epgen build --world-size 2 --max-tokens 8192 --arch sm_90 -o /tmp/epgen-aot --time-import --runs ${RUNS:-5} \
             | tee tools/results/aot-import-ep2-h200.txt ;;
    small) for w in 1 2; do
             timeout ${BENCH_TIMEOUT:-300} python -m epgen bench --world-size $w $([ $w -gt 1 ] && echo --virtual) \
               --tokens 1 128 4096 --routing uniform --iters 50 -o tools/results/${SMALL_TAG:-small}-w$w
           done ;;
    moe) for w in 8 1; do
           timeout ${MOE_TIMEOUT:-300} python -m epgen demo --moe --world-size $w ${MOE_TOKENS:+--tokens $MOE_TOKENS} \
             | tee tools/results/moe-demo-h200-w$w.txt
         done ;;
    moebench) timeout ${MOE_TIMEOUT:-300} python tools/bench_moe.py --world-size 1 ${MOE_TOKENS:+--tokens $MOE_TOKENS} ;;
    qprofile) timeout ${QPROFILE_TIMEOUT:-400} python tools/quant_profile.py ${QPROFILE_ARGS:---sweep} ;;
    qtune) for q in ${QTUNE_WIRES:-fp8_direct_cast fp8_blockwise fp4_blockwise}; do
             timeout ${TUNE_TIMEOUT:-300} python -m epgen tune --world-size 2 --virtual --family normal --quant $q
           done ;;
    qbench) for q in none fp8_blockwise fp4_blockwise; do
              timeout ${BENCH_TIMEOUT:-300} python -m epgen bench --world-size 2 --virtual --quant $q --routing uniform \
                --tokens ${QBENCH_TOKENS:-128 1024 4096 8192} -o tools/results/bench-ep2v-h200-$q
            done ;;
    probe) timeout ${PROBE_TIMEOUT:-200} python tools/p2p_probe.py ;;
    residency) timeout ${PROBE_TIMEOUT:-200} python tools/residency_probe.py ;;
    tests) timeout ${TEST_TIMEOUT:-400} python -m pytest ${TESTS:-tests} -m "gpu or processes" -q -rA --durations=15 \
             ${K:+-k "$K"} ;;
  esac
done
tar czf "$OUT/results.tgz" tools/results codegen/tuning 2>/dev/null
echo "=== done $(date -u +%T)"
