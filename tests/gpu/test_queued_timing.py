"""Queued against host-launched timing of a trivial kernel on one GPU (run on the device machine)."""

import warnings

import pytest


def _tiny():
    import torch

    x = torch.zeros(256, device="cuda")
    return (lambda: x.add_(1.0)), (lambda: x.mul_(0.5))


@pytest.mark.gpu
def test_queued_is_no_slower_than_host_launched_and_covered():
    """A ~2 us kernel: host-launched samples carry the host's launch rate, queued ones do not."""
    from epgen.harness.timing import time_pairs_queued

    first, second = _tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a delay that ran out twice fails the test
        pair = time_pairs_queued(first, second, iters=50, warmup=5)
    assert pair.delay.covered and pair.delay.sleep_us > 0 and pair.delay.enqueue_us > 0
    for queued, host in zip(pair.queued, pair.host):
        assert len(queued.samples_us) == len(host.samples_us) == 50
        assert 0 < queued.median_us <= host.median_us * 1.1 + 1.0  # noise: 10% + 1 us


@pytest.mark.gpu
def test_a_forced_tiny_delay_is_flagged(monkeypatch):
    """A sleep rate a million times too low sizes a delay of a cycle or two: it ends long before
    the host has enqueued 50 pairs, both tries end early, the result is flagged and warned."""
    from epgen.harness import timing

    monkeypatch.setattr(timing, "sleep_rate", lambda: 1e-3)  # cycles per us: a delay of one or two cycles
    first, second = _tiny()
    with pytest.warns(RuntimeWarning, match="ended before the host finished enqueueing 50 pairs"):
        pair = timing.time_pairs_queued(first, second, iters=50, warmup=5)
    assert not pair.delay.covered
