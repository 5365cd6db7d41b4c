"""Device-event timing shared by the demo and the benchmark (README.md, "Measuring")."""

from __future__ import annotations

import statistics

import attrs
import torch


@attrs.frozen
class Timing:
    """Per-iteration device times of one kernel, microseconds."""

    samples_us: tuple[float, ...]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def mean_us(self) -> float:
        return statistics.fmean(self.samples_us)

    @property
    def stdev_us(self) -> float:
        return statistics.stdev(self.samples_us) if len(self.samples_us) > 1 else 0.0

    @property
    def best_us(self) -> float:
        return min(self.samples_us)


def gbps(nbytes: int, us: float) -> float:
    """Bytes over microseconds, in GB/s (1e9 bytes per second)."""
    return nbytes / us / 1e3 if us > 0 else float("nan")


def time_pairs(first, second, iters: int = 20, warmup: int = 3) -> tuple[Timing, Timing]:
    """Time ``first()`` then ``second()`` back to back ``iters`` times with device events around
    each (after ``warmup`` untimed pairs); returns the two Timings."""
    for _ in range(warmup):
        first()
        second()
    torch.cuda.synchronize()
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for e in evs:
        e[0].record()
        first()
        e[1].record()
        second()
        e[2].record()
    torch.cuda.synchronize()
    a = tuple(e[0].elapsed_time(e[1]) * 1e3 for e in evs)
    b = tuple(e[1].elapsed_time(e[2]) * 1e3 for e in evs)
    return Timing(a), Timing(b)
