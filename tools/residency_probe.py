"""What a cooperative launch guarantees on this GPU, and what W processes on one GPU cost.

Measures, in one run (prints a short table last):

1. a grid whose blocks wait for every block of the same grid (a counter all blocks add to, each
   block spinning until it reaches the grid size, bounded), launched plainly and cooperatively
   (``cuLaunchCooperativeKernel`` through ``cupy.cuda.driver.launchCooperativeKernel``) while a
   kernel on another stream holds all but a few SMs for longer than the bound: does either time
   out, and when does it finish;
2. the same cooperative launch captured in a CUDA graph (torch) and replayed: does the capture take it;
3. the cost of the launch mode: K launches of an empty kernel, host-enqueued and as one graph;
4. the start of W processes sharing cuda:0 through ``epgen.harness.ranks.run_ranks`` (W = 2, 3, 4): the
   fixed cost every multi-process test pays.

Usage: python tools/residency_probe.py [--hog-seconds 3] [--bound-seconds 1]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import torch

from epgen.harness.verify import hog_gpu

WAIT = r"""
extern "C" __global__ void grid_wait(unsigned int* counter, unsigned int* timeouts, unsigned long long bound_ns) {
  __shared__ int s_timed_out;
  if (threadIdx.x == 0) {
    s_timed_out = 0;
    const unsigned int total = gridDim.x * gridDim.y;
    atomicAdd(counter, 1u);
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (atomicAdd(counter, 0u) < total) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > bound_ns) { atomicAdd(timeouts, 1u); break; }
      __nanosleep(200);
    }
  }
  __syncthreads();
}
extern "C" __global__ void empty() {}
"""


def _kernels():
    import cupy

    mod = cupy.RawModule(code=WAIT)
    return mod.get_function("grid_wait"), mod.get_function("empty")


def _launch(fn, grid, block, args: list[int], stream_ptr: int, cooperative: bool):
    """Launch ``fn`` with 8-byte ``args`` (pointers / u64) on the stream at ``stream_ptr``."""
    from cupy.cuda import driver

    values = (ctypes.c_uint64 * max(len(args), 1))(*args)
    params = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(values) + 8 * i for i in range(len(args))])
    launch = driver.launchCooperativeKernel if cooperative else (
        lambda *a: driver.launchKernel(*a, 0))
    launch(fn.ptr, grid[0], grid[1], 1, block, 1, 1, 0, stream_ptr, ctypes.addressof(params))
    return values, params  # kept alive until the launch has read them (the caller syncs)


def grid_wait_beside_a_hog(cooperative: bool, blocks: int, hog_s: float, bound_s: float) -> dict:
    fn, _ = _kernels()
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    torch.cuda.synchronize()
    hog_gpu(torch.device("cuda", 0), hog_s, side)  # the tests' busy GPU (epgen.harness.verify)
    time.sleep(0.05)  # the hog's blocks are resident first
    t0 = time.monotonic()
    keep = _launch(fn.kernel, (blocks, 1), 512, [counter.data_ptr(), counter.data_ptr() + 4, int(bound_s * 1e9)],
                   main.cuda_stream, cooperative)
    main.synchronize()
    took = time.monotonic() - t0
    side.synchronize()
    del keep
    return {"case": f"grid wait, {blocks} blocks, {'cooperative' if cooperative else 'plain'}, hog {hog_s} s",
            "timeouts": int(counter[1]), "arrived": int(counter[0]), "seconds": round(took, 3)}


def cooperative_in_a_graph(blocks: int) -> dict:
    fn, _ = _kernels()
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(g, stream=s):
            keep = _launch(fn.kernel, (blocks, 1), 512, [counter.data_ptr(), counter.data_ptr() + 4, int(1e9)],
                           torch.cuda.current_stream().cuda_stream, True)
        for _ in range(3):
            counter.zero_()
            g.replay()
            torch.cuda.synchronize()
        ok = int(counter[0]) == blocks and int(counter[1]) == 0
        del keep
        return {"case": f"cooperative launch captured in a graph, {blocks} blocks", "timeouts": int(counter[1]),
                "arrived": int(counter[0]), "seconds": float("nan"), "ok": ok}
    except Exception as e:  # noqa: BLE001 (the probe reports whatever the driver says)
        return {"case": f"cooperative launch captured in a graph: {type(e).__name__}: {e}", "timeouts": -1,
                "arrived": -1, "seconds": float("nan")}


def launch_cost(cooperative: bool, k: int = 200) -> dict:
    _, empty = _kernels()
    stream = torch.cuda.current_stream().cuda_stream
    keep = [_launch(empty.kernel, (64, 1), 256, [], stream, cooperative) for _ in range(20)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    keep = [_launch(empty.kernel, (64, 1), 256, [], stream, cooperative) for _ in range(k)]
    host_us = (time.perf_counter() - t0) / k * 1e6
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        keep += [_launch(empty.kernel, (64, 1), 256, [], torch.cuda.current_stream().cuda_stream, cooperative)
                 for _ in range(k)]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / k)
    del keep
    return {"case": f"empty 64-block kernel, {'cooperative' if cooperative else 'plain'}", "host_us": round(host_us, 2),
            "graph_us": round(float(np.median(times)), 3)}


def _start_body(rank, world_size):
    import epgen.op  # noqa: F401  (what a test's body imports)


def process_start(world_size: int) -> dict:
    from epgen.harness.ranks import run_ranks

    t0 = time.monotonic()
    run_ranks(world_size, _start_body, timeout_s=120)
    return {"case": f"run_ranks({world_size}) sharing cuda:0, empty body", "seconds": round(time.monotonic() - t0, 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hog-seconds", type=float, default=3.0)
    p.add_argument("--bound-seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cooperative in (False, True):
        rows.append(grid_wait_beside_a_hog(cooperative, 2 * sms, args.hog_seconds, args.bound_seconds))
    rows.append(cooperative_in_a_graph(64))
    rows += [launch_cost(False), launch_cost(True)]
    rows += [process_start(w) for w in (2, 3, 4)]
    print("\n| case | result |\n|---|---|")
    for r in rows:
        print(f"| {r.pop('case')} | {', '.join(f'{k} {v}' for k, v in r.items())} |")


if __name__ == "__main__":
    main()
