"""Which copy mechanism carries rows over NVLink fastest with few SMs (two GPUs, one process).

Each GPU runs the same kernel at the same time (both directions busy, as in a W = 2 dispatch or
combine) on N rows of ROW bytes. Mechanisms:
  st_remote   16-byte loads of local rows, 16-byte stores into the peer (the P2P ceiling pattern)
  st_dual     the dispatch pattern: each warp loads a row once, stores it to the peer and locally
  tma_remote  bulk copies (cp.async.bulk): row -> shared memory -> peer, lane 0 of each warp
  tma_dual    the same, the staged row also stored locally (the dispatch pattern on the TMA)
  ld_pull     the combine pattern: 16-byte loads from the peer's row and the local row, fp32 sum, store
  tma_pull    bulk loads of the peer's row and the local row into shared memory, lanes sum, store
Prints GB/s of peer bytes per direction (the wire rate the benchmark reports), median of 20.

Usage (on a machine with two GPUs joined by NVLink): python tools/p2p_probe.py [--rows 4096]
"""
from __future__ import annotations

import argparse
import statistics
import warnings

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
constexpr int kRowBytes = ROW_BYTES;
constexpr int kRowVectors = kRowBytes / 16;
constexpr int kStages = STAGES;
extern __shared__ __align__(128) char sm[];  // 1024 bytes of barriers (kStages per warp), then each warp's stages

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(u64* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(b)));
}
__device__ __forceinline__ void bar_expect(u64* b, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(u64* b, u32 parity) {
  asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }"
               ::"r"(smem(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(b)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

extern "C" __global__ void st_remote(const uint4* src, uint4* peer, uint4* local, u64 rows) {
  const u64 n = rows * kRowVectors, stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) if (i + u * stride < n) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) if (i + u * stride < n) peer[i + u * stride] = v[u];
  }
}

template <bool kLocal>
__device__ __forceinline__ void st_rows(const uint4* src, uint4* peer, uint4* local, u64 rows) {
  const int lane = threadIdx.x & 31;
  const u64 warps = (u64)gridDim.x * (blockDim.x / 32);
  for (u64 r = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    for (int c = 0; c < kRowVectors; c += 128) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) { const int i = c + u * 32 + lane; if (i < kRowVectors) v[u] = __ldg(src + r * kRowVectors + i); }
#pragma unroll
      for (int u = 0; u < 4; ++u) { const int i = c + u * 32 + lane; if (i < kRowVectors) peer[r * kRowVectors + i] = v[u]; }
      if (kLocal) {
#pragma unroll
        for (int u = 0; u < 4; ++u) { const int i = c + u * 32 + lane; if (i < kRowVectors) local[r * kRowVectors + i] = v[u]; }
      }
    }
  }
}
extern "C" __global__ void st_dual(const uint4* src, uint4* peer, uint4* local, u64 rows) { st_rows<true>(src, peer, local, rows); }

// Lane 0 of each warp: stage s of the warp holds one row; loads run kStages - 1 rows ahead.
template <bool kLocal>
__device__ __forceinline__ void tma_rows(const char* src, char* peer, char* local, u64 rows) {
  const int warp = threadIdx.x / 32, nw = blockDim.x / 32;
  u64* bars = (u64*)sm + warp * kStages;
  char* stage = sm + 1024 + (u64)warp * kStages * kRowBytes;
  if ((threadIdx.x & 31) != 0) return;
  for (int s = 0; s < kStages; ++s) bar_init(bars + s);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const u64 first = (u64)blockIdx.x * nw + warp, step = (u64)gridDim.x * nw;
  for (int s = 0; s < kStages - 1; ++s) {
    const u64 r = first + s * step;
    if (r < rows) { bar_expect(bars + s, kRowBytes); bulk_load(stage + s * kRowBytes, src + r * kRowBytes, kRowBytes, bars + s); }
  }
  u64 k = 0;
  for (u64 r = first; r < rows; r += step, ++k) {
    const int s = (int)(k % kStages);
    bar_wait(bars + s, (u32)((k / kStages) & 1));
    bulk_store(peer + r * kRowBytes, stage + s * kRowBytes, kRowBytes);
    if (kLocal) bulk_store(local + r * kRowBytes, stage + s * kRowBytes, kRowBytes);
    bulk_commit();
    bulk_wait_read<1>();  // row k-1's stores have read their stage: it takes row k + kStages - 1
    const u64 rn = r + (u64)(kStages - 1) * step;
    const int sn = (int)((k + kStages - 1) % kStages);
    if (rn < rows) { bar_expect(bars + sn, kRowBytes); bulk_load(stage + sn * kRowBytes, src + rn * kRowBytes, kRowBytes, bars + sn); }
  }
  bulk_wait_all();
}
extern "C" __global__ void tma_remote(const char* src, char* peer, char* local, u64 rows) { tma_rows<false>(src, peer, local, rows); }
extern "C" __global__ void tma_dual(const char* src, char* peer, char* local, u64 rows) { tma_rows<true>(src, peer, local, rows); }

__device__ __forceinline__ void add8(float* acc, uint4 v) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) { acc[2 * k] += __uint_as_float(w[k] << 16); acc[2 * k + 1] += __uint_as_float(w[k] & 0xffff0000u); }
}
__device__ __forceinline__ u32 pack(float lo, float hi) {
  u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ uint4 ld_peer(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 { %0, %1, %2, %3 }, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// (row, chunk of 128 vectors) items over every warp; the peer's row and the local row summed.
extern "C" __global__ void ld_pull(const uint4* peer, const uint4* local, uint4* out, u64 rows) {
  const int lane = threadIdx.x & 31;
  constexpr int kChunks = (kRowVectors + 127) / 128;
  const u64 warps = (u64)gridDim.x * (blockDim.x / 32);
  for (u64 it = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; it < rows * kChunks; it += warps) {
    const u64 r = it / kChunks; const int c = (int)(it % kChunks) * 128;
    uint4 a[4], b[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { const int i = c + u * 32 + lane; if (i < kRowVectors) { a[u] = ld_peer(peer + r * kRowVectors + i); b[u] = __ldg(local + r * kRowVectors + i); } }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = c + u * 32 + lane;
      if (i < kRowVectors) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; add8(acc, a[u]); add8(acc, b[u]);
        out[r * kRowVectors + i] = make_uint4(pack(acc[0], acc[1]), pack(acc[2], acc[3]), pack(acc[4], acc[5]), pack(acc[6], acc[7]));
      }
    }
  }
}

// Each warp: stage s holds the peer's row and the local row (two bulk loads, one barrier).
extern "C" __global__ void tma_pull(const char* peer, const char* local, char* out, u64 rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  u64* bars = (u64*)sm + warp * kStages;
  char* stage = sm + 1024 + (u64)warp * kStages * 2 * kRowBytes;
  if (lane == 0) { for (int s = 0; s < kStages; ++s) bar_init(bars + s); asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
  __syncwarp();
  const u64 first = (u64)blockIdx.x * nw + warp, step = (u64)gridDim.x * nw;
  auto issue = [&](u64 r, int s) {
    if (lane == 0 && r < rows) {
      bar_expect(bars + s, 2 * kRowBytes);
      bulk_load(stage + (u64)s * 2 * kRowBytes, peer + r * kRowBytes, kRowBytes, bars + s);
      bulk_load(stage + (u64)s * 2 * kRowBytes + kRowBytes, local + r * kRowBytes, kRowBytes, bars + s);
    }
  };
  for (int s = 0; s < kStages; ++s) issue(first + s * step, s);
  u64 k = 0;
  for (u64 r = first; r < rows; r += step, ++k) {
    const int s = (int)(k % kStages);
    bar_wait(bars + s, (u32)((k / kStages) & 1));
    const uint4* a = (const uint4*)(stage + (u64)s * 2 * kRowBytes);
    const uint4* b = a + kRowVectors;
    for (int i = lane; i < kRowVectors; i += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; add8(acc, a[i]); add8(acc, b[i]);
      ((uint4*)out)[r * kRowVectors + i] = make_uint4(pack(acc[0], acc[1]), pack(acc[2], acc[3]), pack(acc[4], acc[5]), pack(acc[6], acc[7]));
    }
    __syncwarp();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before the next bulk write
    issue(r + (u64)kStages * step, s);
  }
}
"""


# (kernel, threads, stages, rows a stage holds): the bulk-copy kernels stage rows in shared memory,
# 1024 bytes of barriers plus warps x stages x rows x row bytes a block.
VARIANTS = [("st_remote", 512, 1, 0), ("st_remote", 1024, 1, 0), ("st_dual", 1024, 1, 0),
            ("tma_remote", 128, 3, 1), ("tma_dual", 128, 3, 1), ("tma_dual", 256, 2, 1), ("tma_dual", 64, 6, 1),
            ("ld_pull", 1024, 1, 0), ("tma_pull", 128, 2, 2), ("tma_pull", 256, 1, 2), ("tma_pull", 64, 3, 2)]
SHARED_LIMIT = 227 * 1024  # bytes of dynamic shared memory a block may use on sm_90


def shared_bytes(threads: int, stages: int, rows: int, row_bytes: int) -> int:
    """Dynamic shared memory of one variant's block (0 for the kernels without bulk copies)."""
    return 1024 + threads // 32 * stages * rows * row_bytes if rows else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--row-bytes", type=int, default=14336)
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 24, 32, 132])
    args = p.parse_args()
    for flag, values in (("--rows", args.rows), ("--blocks", args.blocks), ("--row-bytes", [args.row_bytes])):
        if min(values) < 1:
            p.error(f"{flag} {' '.join(map(str, values))}: must be at least 1")
    if args.row_bytes % 16:
        p.error(f"--row-bytes {args.row_bytes}: must be a multiple of 16 (16-byte vectors and bulk copies)")
    staged = max(threads // 32 * stages * rows for _, threads, stages, rows in VARIANTS)
    if shared_bytes(32 * staged, 1, 1, args.row_bytes) > SHARED_LIMIT:
        p.error(f"--row-bytes {args.row_bytes}: the bulk-copy kernels stage up to {staged} rows in "
                f"{SHARED_LIMIT // 1024} KB of shared memory; at most {(SHARED_LIMIT - 1024) // staged // 16 * 16} bytes")
    try:
        import cupy
    except ImportError:
        raise SystemExit("p2p_probe: needs CuPy (pip install -e '.[cuda]') and two GPUs joined by NVLink") from None
    warnings.filterwarnings("ignore", message="The device where the array resides")
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise SystemExit(f"p2p_probe: no CUDA device ({e}); it needs two GPUs joined by NVLink")
    if gpus < 2:
        raise SystemExit(f"p2p_probe: {gpus} GPU(s) visible; it needs two GPUs joined by NVLink")
    for d, peer in ((0, 1), (1, 0)):
        with cupy.cuda.Device(d):
            cupy.cuda.runtime.deviceEnablePeerAccess(peer)
    mods = {}

    def kernel(name, stages):
        key = (name, stages)
        if key not in mods:
            src = SOURCE.replace("ROW_BYTES", str(args.row_bytes)).replace("STAGES", str(stages))
            mods[key] = [None, None]
            for d in (0, 1):
                with cupy.cuda.Device(d):
                    mods[key][d] = cupy.RawModule(code=src, options=("-std=c++17", "--gpu-architecture=sm_90"),
                                                  name_expressions=None).get_function(name)
        return mods[key]

    rows_max = max(args.rows)
    nbytes = rows_max * args.row_bytes
    buf = []
    for d in (0, 1):
        with cupy.cuda.Device(d):
            src = cupy.random.randint(0, 255, nbytes, dtype=cupy.uint8)
            buf.append({"src": src, "recv": cupy.zeros(nbytes, cupy.uint8), "local": cupy.zeros(nbytes, cupy.uint8),
                        "stream": cupy.cuda.Stream(non_blocking=True)})
    failures = []

    def poison():
        for d in (0, 1):
            with cupy.cuda.Device(d):
                buf[d]["recv"].fill(0xAB)
                buf[d]["local"].fill(0xAB)

    def check(name, rows):
        n = rows * args.row_bytes
        for d in (0, 1):
            with cupy.cuda.Device(d):
                b, o = buf[d], buf[1 - d]
                if name in ("ld_pull", "tma_pull"):
                    def lo(a):
                        return (a[:n].view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
                    want = lo(o["src"]) + lo(b["src"])
                    got = lo(b["local"])  # bf16 of the fp32 sum: within 2^-8 relative
                    far = cupy.abs(got - want) > cupy.abs(want) * 2.0 ** -8
                    bad = int(cupy.count_nonzero(far & (cupy.abs(want) < 3.0e38)))  # bf16 overflow to inf is right
                else:
                    bad = int(cupy.count_nonzero(o["recv"][:n] != b["src"][:n]))
                    if name in ("st_dual", "tma_dual"):
                        bad += int(cupy.count_nonzero(b["local"][:n] != b["src"][:n]))
                if bad:
                    failures.append(f"{name} on GPU {d}: {bad} differ")

    # (name, threads, stages, shared bytes); pull kernels read the peer's "src" and write "local"
    print(f"{'kernel':<11} {'threads':>7} {'stages':>6} {'smem KB':>7} " + " ".join(
        f"{f'{b}b/{r}r':>12}" for r in args.rows for b in args.blocks))
    for name, threads, stages, staged_rows in VARIANTS:
        shm = shared_bytes(threads, stages, staged_rows, args.row_bytes)
        fns = kernel(name, stages)
        poison()
        cells = []
        for rows in args.rows:
            for blocks in args.blocks:
                def launch():
                    for d in (0, 1):
                        with cupy.cuda.Device(d):
                            b, o = buf[d], buf[1 - d]
                            if name in ("ld_pull", "tma_pull"):
                                a3 = (o["src"], b["src"], b["local"])
                            else:
                                a3 = (b["src"], o["recv"], b["local"])
                            fns[d]((blocks,), (threads,), a3 + (cupy.uint64(rows),), stream=b["stream"], shared_mem=shm)
                times = []
                try:
                    for d, f in enumerate(fns):
                        with cupy.cuda.Device(d):
                            f.max_dynamic_shared_size_bytes = shm
                    for it in range(25):
                        ev = []
                        for d in (0, 1):
                            with cupy.cuda.Device(d):
                                e0 = cupy.cuda.Event(); e0.record(buf[d]["stream"]); ev.append(e0)
                        launch()
                        for d in (0, 1):
                            with cupy.cuda.Device(d):
                                e1 = cupy.cuda.Event(); e1.record(buf[d]["stream"]); ev.append(e1)
                        for d in (0, 1):
                            with cupy.cuda.Device(d):
                                buf[d]["stream"].synchronize()
                        if it >= 5:
                            times.append(max(cupy.cuda.get_elapsed_time(ev[d], ev[2 + d]) for d in (0, 1)))
                    if rows == args.rows[0] and blocks == args.blocks[0]:
                        check(name, rows)
                    gbps = rows * args.row_bytes / (statistics.median(times) * 1e-3) / 1e9
                    cells.append(f"{gbps:12.1f}")
                except cupy.cuda.driver.CUDADriverError as e:
                    cells.append(f"{'ERR':>12}")
                    print(name, e)
        print(f"{name:<11} {threads:>7} {stages:>6} {shm // 1024:>7} " + " ".join(cells), flush=True)
    if failures:
        raise SystemExit("wrong bytes: " + ", ".join(failures))


if __name__ == "__main__":
    main()
