"""Device-event timing shared by the demo and the benchmark (docs/measuring.md).

Two ways to time a pair of launches, both with device events around each launch:

* host-launched (``time_pairs``): the host enqueues event, ``first()``, event, ``second()``, event
  while the GPU runs them, so a launch shorter than the host's enqueue of the next one is timed
  at the host's launch rate (an idle gap lands between events).
* queued (``time_pairs_queued``, the primary figure of ``epgen bench`` and ``epgen tune``): the
  same events and launches enqueued behind one GPU-side delay (``torch.cuda._sleep``) that lasts
  longer than the host takes to enqueue them all, so the GPU runs them back to back and each
  sample is the kernel's own time. Chosen over capturing K iterations in one graph and dividing
  by K because it keeps one sample per iteration (median, mean, stdev and best stay
  meaningful) and times the launches exactly as the caller makes them. The delay is sized from
  the host enqueue time measured in the host-launched pass and the sleep's clock rate measured
  on the device; when the delay ended before the host finished enqueueing (the sleep's end
  event had completed when the last launch was enqueued) the run is repeated once with a delay
  sized from that run's enqueue time, and if it ends early again the result says so
  (``QueueDelay.covered`` False) and a RuntimeWarning is raised: a queued figure never silently
  becomes a host-bound one.

Every process times its own device's current stream: with real ranks each rank queues its own
launches (callers barrier first); virtual ranks are one process. The queued run holds
5 x ``iters`` launches and events pending at once: keep that within the driver's launch queue
(about a thousand entries on CUDA), beyond which the host blocks until the delay ends and the
run is flagged.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings

import attrs
import torch

SLEEP_MARGIN = 2.0
"""The delay lasts this many times the measured host enqueue time (the enqueue rate varies run
to run and the SM clock the sleep counts may rise between calibration and use)."""
SLEEP_PAD_US = 50.0
"""Added to the delay: the host's time between the sleep's launch and the first timed enqueue."""
CALIBRATION_CYCLES = 1_000_000
"""Length of the sleep whose device time gives the sleep's cycles per microsecond."""


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


@attrs.frozen
class QueueDelay:
    """The GPU-side delay of a queued run: its device time and the host's time to enqueue the
    timed launches behind it (microseconds); ``covered`` is False when the delay had ended
    before the last launch was enqueued (the samples are then partly host-bound)."""

    sleep_us: float
    enqueue_us: float
    covered: bool


@attrs.frozen
class PairTiming:
    """``queued`` and ``host`` are (first, second) Timings of the two ways (module docstring);
    ``queued`` is the primary figure, ``delay`` the queued run's delay."""

    queued: tuple[Timing, Timing]
    host: tuple[Timing, Timing]
    delay: QueueDelay


def gbps(nbytes: int, us: float) -> float:
    """Bytes over microseconds, in GB/s (1e9 bytes per second)."""
    return nbytes / us / 1e3 if us > 0 else float("nan")


def sleep_cycles(enqueue_us: float, cycles_per_us: float, margin: float = SLEEP_MARGIN,
                 pad_us: float = SLEEP_PAD_US) -> int:
    """Cycles of ``torch.cuda._sleep`` that cover a host enqueue of ``enqueue_us`` microseconds:
    ``ceil((margin x enqueue_us + pad_us) x cycles_per_us)``.

    Raises:
        ValueError: ``enqueue_us`` negative or not finite, ``cycles_per_us`` not a positive
            finite number, ``margin`` below 1 or ``pad_us`` negative.
    """
    if not (math.isfinite(enqueue_us) and enqueue_us >= 0):
        raise ValueError(f"enqueue_us={enqueue_us!r}: must be a finite number >= 0 (host microseconds)")
    if not (math.isfinite(cycles_per_us) and cycles_per_us > 0):
        raise ValueError(f"cycles_per_us={cycles_per_us!r}: must be a finite number > 0 (measured sleep rate)")
    if not margin >= 1:
        raise ValueError(f"margin={margin!r}: must be >= 1 (the delay must outlast the enqueue)")
    if not pad_us >= 0:
        raise ValueError(f"pad_us={pad_us!r}: must be >= 0 microseconds")
    return math.ceil((margin * enqueue_us + pad_us) * cycles_per_us)


def sleep_rate(cycles: int = CALIBRATION_CYCLES) -> float:
    """Cycles per microsecond of ``torch.cuda._sleep`` on the current device, from device events
    around one sleep of ``cycles`` (synchronizes the device)."""
    torch.cuda._sleep(1)  # the first launch loads the kernel: keep that out of the timed one
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def _enqueue(first, second, iters: int) -> tuple[list, float]:
    """Enqueue ``iters`` x (event, first, event, second, event); returns the events and the
    host's microseconds to enqueue them."""
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    t0 = time.perf_counter()
    for e in evs:
        e[0].record()
        first()
        e[1].record()
        second()
        e[2].record()
    return evs, (time.perf_counter() - t0) * 1e6


def _read(evs) -> tuple[Timing, Timing]:
    return (Timing(tuple(e[0].elapsed_time(e[1]) * 1e3 for e in evs)),
            Timing(tuple(e[1].elapsed_time(e[2]) * 1e3 for e in evs)))


def _check_iters(iters: int, warmup: int) -> None:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters={iters!r}: must be an int >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: must be an int >= 0")


def time_pairs(first, second, iters: int = 20, warmup: int = 3) -> tuple[Timing, Timing]:
    """Host-launched: time ``first()`` then ``second()`` back to back ``iters`` times with device
    events around each (after ``warmup`` untimed pairs); returns the two Timings.

    Raises:
        ValueError: ``iters`` not an int >= 1 or ``warmup`` not an int >= 0.
    """
    return _host_pass(first, second, iters, warmup)[0]


def _host_pass(first, second, iters: int, warmup: int):
    """The host-launched pass after ``warmup`` untimed pairs: (the two Timings, host enqueue us)."""
    _check_iters(iters, warmup)
    for _ in range(warmup):
        first()
        second()
    torch.cuda.synchronize()
    evs, enqueue_us = _enqueue(first, second, iters)
    torch.cuda.synchronize()
    return _read(evs), enqueue_us


def time_pairs_queued(first, second, iters: int = 20, warmup: int = 3) -> PairTiming:
    """Time ``first()`` then ``second()`` (each first followed by its second) ``iters`` times both
    ways (module docstring): host-launched, then queued behind a delay sized from that pass's
    host enqueue time. Warns (RuntimeWarning) when the delay did not cover the enqueue twice.

    Raises:
        ValueError: ``iters`` not an int >= 1 or ``warmup`` not an int >= 0.
    """
    host, enqueue_us = _host_pass(first, second, iters, warmup)
    rate = sleep_rate()
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(sleep_cycles(enqueue_us, rate))
        end.record()
        evs, took_us = _enqueue(first, second, iters)
        ended_early = end.query()  # the GPU reached the timed launches before the host had enqueued them all
        torch.cuda.synchronize()
        delay = QueueDelay(sleep_us=start.elapsed_time(end) * 1e3, enqueue_us=took_us, covered=not ended_early)
        if delay.covered:
            break
        enqueue_us = max(enqueue_us, took_us)
    else:
        warnings.warn(f"queued timing: the GPU-side delay ({delay.sleep_us:.0f} us) ended before the host finished "
                      f"enqueueing {iters} pairs ({delay.enqueue_us:.0f} us) twice; the queued samples are partly "
                      f"host-bound (QueueDelay.covered is False)", RuntimeWarning, stacklevel=2)
    return PairTiming(queued=_read(evs), host=host, delay=delay)
