"""The two timing methods of epgen.harness.timing on a simulated GPU stream (CPU): the delay's sizing
arithmetic, queued samples that are the kernels' own times where host-launched ones are the
host's launch rate, and the flag raised when the delay ends before the host finished enqueueing."""

import types

import pytest

from epgen.harness import timing
from epgen.harness.timing import sleep_cycles


class _Gpu:
    """One in-order stream: an op enqueued at host time t starts at max(t, end of the previous
    op) and runs for its duration; the host clock advances by each call's host cost (us)."""

    def __init__(self, cycles_per_us, sleep_speedup=1.0, launch_us=6.0, record_us=1.0):
        self.now = 0.0  # host clock
        self.free = 0.0  # when the GPU finishes what is queued
        self.cycles_per_us, self.sleep_speedup = cycles_per_us, sleep_speedup
        self.launch_us, self.record_us = launch_us, record_us
        self.sleeps = []  # cycles of every sleep enqueued
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                gpu.now += gpu.record_us
                self.t = gpu.free = max(gpu.now, gpu.free)

            def query(self):
                return self.t <= gpu.now

            def synchronize(self):
                gpu.now = max(gpu.now, self.t)

            def elapsed_time(self, other):  # milliseconds, as torch
                return (other.t - self.t) / 1e3

        def _sleep(cycles):
            gpu.sleeps.append(cycles)
            rate = gpu.cycles_per_us * (gpu.sleep_speedup if len(gpu.sleeps) > 2 else 1.0)  # 1, 2: calibration
            gpu.run(cycles / rate)

        def synchronize():
            gpu.now = max(gpu.now, gpu.free)

        self.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, _sleep=_sleep, synchronize=synchronize))
        self.time = types.SimpleNamespace(perf_counter=lambda: gpu.now / 1e6)

    def run(self, gpu_us):
        self.now += self.launch_us
        self.free = max(self.now, self.free) + gpu_us


@pytest.fixture
def gpu(monkeypatch, request):
    g = _Gpu(**getattr(request, "param", {"cycles_per_us": 1980.0}))
    monkeypatch.setattr(timing, "torch", g.torch)
    monkeypatch.setattr(timing, "time", g.time)
    return g


def test_sleep_cycles_covers_margin_times_the_enqueue_plus_the_pad():
    assert sleep_cycles(100.0, 2000.0, margin=2.0, pad_us=50.0) == 500_000  # (2 x 100 + 50) us x 2000 / us
    assert sleep_cycles(0.0, 1.5, margin=1.0, pad_us=1.0) == 2  # rounded up: never shorter than asked
    assert sleep_cycles(10.0, 1000.0) == round((timing.SLEEP_MARGIN * 10 + timing.SLEEP_PAD_US) * 1000)


@pytest.mark.parametrize("kwargs, match", [
    ({"enqueue_us": -1.0}, r"enqueue_us=-1.0: must be a finite number >= 0"),
    ({"enqueue_us": float("inf")}, r"enqueue_us=inf: must be a finite number >= 0"),
    ({"cycles_per_us": 0.0}, r"cycles_per_us=0.0: must be a finite number > 0"),
    ({"cycles_per_us": float("nan")}, r"cycles_per_us=nan: must be a finite number > 0"),
    ({"margin": 0.5}, r"margin=0.5: must be >= 1"),
    ({"pad_us": -2.0}, r"pad_us=-2.0: must be >= 0"),
])
def test_sleep_cycles_rejects(kwargs, match):
    args = {"enqueue_us": 10.0, "cycles_per_us": 1000.0} | kwargs
    with pytest.raises(ValueError, match=match):
        sleep_cycles(**args)


def test_sleep_rate_is_measured_on_the_device(gpu):
    assert timing.sleep_rate(500_000) == pytest.approx(1980.0, rel=0.05)  # launch cost inside the events


def test_queued_samples_are_the_kernels_times_host_launched_ones_the_launch_rate(gpu):
    first, second = (lambda: gpu.run(2.0)), (lambda: gpu.run(3.0))
    pair = timing.time_pairs_queued(first, second, iters=10, warmup=2)
    assert pair.delay.covered and pair.delay.sleep_us > pair.delay.enqueue_us
    assert pair.queued[0].samples_us == pytest.approx((2.0,) * 10)  # back to back on the GPU
    assert pair.queued[1].samples_us == pytest.approx((3.0,) * 10)
    # host-launched: every sample holds a whole host launch, not the kernel's 2 or 3 us alone
    assert min(pair.host[0].samples_us) >= gpu.launch_us and min(pair.host[1].samples_us) >= gpu.launch_us
    assert len(gpu.sleeps) == 3  # warm-up, calibration, one covering delay
    assert timing.time_pairs(first, second, iters=10, warmup=2) == pair.host  # the same host-launched pass


@pytest.mark.parametrize("gpu", [{"cycles_per_us": 1980.0, "sleep_speedup": 100.0}], indirect=True)
def test_a_delay_that_ends_before_the_enqueue_is_retried_then_flagged(gpu):
    """The SM clock 100x faster after calibration: every delay ends early, the run is repeated once
    with a delay sized from the failed run, then flagged and warned, never passed off as queued."""
    with pytest.warns(RuntimeWarning, match=r"ended before the host finished enqueueing 10 pairs .* host-bound"):
        pair = timing.time_pairs_queued(lambda: gpu.run(2.0), lambda: gpu.run(3.0), iters=10, warmup=0)
    assert not pair.delay.covered
    assert pair.delay.sleep_us < pair.delay.enqueue_us
    assert len(gpu.sleeps) == 4 and gpu.sleeps[3] >= gpu.sleeps[2]  # one retry, at least as long
    assert pair.queued[0].median_us > 2.0  # host-bound samples: exactly what the flag reports


@pytest.mark.parametrize("gpu", [{"cycles_per_us": 1980.0, "sleep_speedup": 1.6}], indirect=True)
def test_a_retry_sized_from_the_failed_run_is_covered(gpu):
    """A clock 1.6x faster than calibrated shortens the first delay below a slower enqueue (the
    timed pass enqueues slower than the host pass: launch cost grows after the first pass)."""
    calls = {"n": 0}

    def first():
        calls["n"] += 1
        gpu.run(2.0)
        if calls["n"] > 10:  # after the host-launched pass the host is 3x slower per launch
            gpu.now += 2 * gpu.launch_us

    pair = timing.time_pairs_queued(first, lambda: gpu.run(3.0), iters=10, warmup=0)
    assert pair.delay.covered and len(gpu.sleeps) == 4  # the first delay ended early, the retry did not
    assert pair.queued[0].samples_us == pytest.approx((2.0,) * 10)


@pytest.mark.parametrize("iters, warmup, match", [(0, 3, r"iters=0: must be an int >= 1"),
                                                  (True, 3, r"iters=True: must be an int >= 1"),
                                                  (5, -1, r"warmup=-1: must be an int >= 0")])
def test_bad_iteration_counts_are_refused(iters, warmup, match):
    with pytest.raises(ValueError, match=match):
        timing.time_pairs_queued(lambda: None, lambda: None, iters=iters, warmup=warmup)
