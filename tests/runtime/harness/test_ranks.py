"""The multi-process launcher on the CPU: a hung rank is killed at the bound, a rank that exits
early with status 0 (a test's dead peer) is not a failure, a rank that raises is."""

import os
import time

import pytest
import torch

from epgen.harness.ranks import start_and_join


def _rank_body(rank, mode):
    if rank == 1 and mode == "hang":
        time.sleep(600)
    if rank == 1 and mode == "exit":
        os._exit(0)
    if rank == 1 and mode == "raise":
        raise ValueError("rank 1 broke")


@pytest.mark.slow
def test_a_hung_rank_is_killed_at_the_bound():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still running after timeout_s=10") as e:
        start_and_join(_rank_body, ("hang",), 2, timeout_s=10)
    assert "1]" in str(e.value) and time.monotonic() - t0 < 40


@pytest.mark.slow
def test_an_early_exit_with_status_0_is_not_a_failure():
    start_and_join(_rank_body, ("exit",), 2, timeout_s=60)


@pytest.mark.slow
def test_a_raising_rank_fails_the_run():
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="rank 1 broke"):
        start_and_join(_rank_body, ("raise",), 2, timeout_s=60)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_run_ranks_rejects_a_world_size_below_one(world_size):
    from epgen.harness.ranks import run_ranks

    with pytest.raises(ValueError, match=r"world_size=.*: must be an int >= 1"):
        run_ranks(world_size, print)


# ---- the pool that run_ranks keeps (on the CPU: gloo, no device) -----------------------------------

def _pid_body(rank, world_size, folder):
    import torch.distributed as dist

    assert dist.get_world_size() == world_size and dist.get_rank() == rank
    with open(os.path.join(folder, f"pid{rank}"), "a") as f:
        f.write(f"{os.getpid()}\n")


@pytest.mark.slow
def test_a_pool_runs_one_function_after_another_in_the_same_processes(tmp_path):
    from epgen.harness.ranks import RankPool

    pool = RankPool(3)
    try:
        for _ in range(3):
            pool.run(_pid_body, (str(tmp_path),), timeout_s=120)
        for rank in range(3):
            pids = (tmp_path / f"pid{rank}").read_text().split()
            assert len(pids) == 3 and len(set(pids)) == 1, f"rank {rank} ran in processes {pids}"
        assert pool.alive
    finally:
        pool.close()
    assert not pool.alive


@pytest.mark.parametrize("mode,error", [("hang", TimeoutError), ("raise", torch.multiprocessing.ProcessRaisedException),
                                        ("exit", None)])
@pytest.mark.slow
def test_a_pool_ends_on_any_failure_and_an_early_exit_0_is_no_failure(mode, error):
    from epgen.harness.ranks import RankPool

    pool = RankPool(2)
    try:
        if error is None:
            pool.run(_pool_body, (mode,), timeout_s=120)
        else:
            with pytest.raises(error, match="rank 1 broke" if mode == "raise" else "still running after"):
                pool.run(_pool_body, (mode,), timeout_s=60 if mode == "raise" else 10)
        assert not pool.alive, "a run that failed or lost a rank leaves no process behind"
    finally:
        pool.close()


def _pool_body(rank, world_size, mode):
    _rank_body(rank, mode)


@pytest.mark.slow
@pytest.mark.parametrize("timeout_s", ["5", 0, -1, True, float("nan"), float("inf"), 2e6])
def test_a_bad_timeout_is_refused_before_any_rank_runs(timeout_s, tmp_path):
    from epgen.harness.ranks import RankPool

    rule = r"timeout_s=.*: must be None \(no bound\) or a real number of seconds in \(0, 1e\+06\]"
    with pytest.raises(ValueError, match=rule):
        start_and_join(_rank_body, ("hang",), 2, timeout_s=timeout_s)
    pool = RankPool(2)
    try:
        with pytest.raises(ValueError, match=rule):
            pool.run(_pid_body, (str(tmp_path),), timeout_s=timeout_s)
        assert not list(tmp_path.iterdir()), "a rank ran"
        pool.run(_pid_body, (str(tmp_path),), timeout_s=120)  # the pool is still in step
        assert sorted(p.name for p in tmp_path.iterdir()) == ["pid0", "pid1"]
    finally:
        pool.close()


def test_ctrl_c_while_rank_processes_run_is_one_line_and_status_130(tmp_path):
    """SIGINT to the whole process group (Ctrl-C at a terminal) while a verb waits on its rank
    processes, and while they wait idle for the next run: the pool processes ignore it (an idle one
    used to print its own KeyboardInterrupt traceback), the parent ends them and prints one line,
    status 130."""
    import signal
    import subprocess
    import sys

    (tmp_path / "sleeper.py").write_text("import time\n\n\ndef body(rank, world_size):\n"
                                         "    if rank == 0:\n        print('started', flush=True)\n"
                                         "    time.sleep(120)\n\n\n"
                                         "def quick(rank, world_size):\n    pass\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for work in ("run_ranks(2, sleeper.body)",  # interrupted while the ranks run
                 "(run_ranks(2, sleeper.quick), print('started', flush=True), time.sleep(120))"):  # while idle
        code = ("import sys, time, sleeper, epgen.cli.commands as c\n"
                "from epgen.harness.ranks import run_ranks\n"
                f"c.cmd_plan = lambda *a: {work}\n"
                "sys.exit(c.main(['plan']))\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, start_new_session=True)
        try:
            assert p.stdout.readline().strip() == "started"
            time.sleep(0.5)
            os.killpg(p.pid, signal.SIGINT)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        assert p.returncode == 130 and err.strip() == "epgen plan: interrupted", (work, err)
