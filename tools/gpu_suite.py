"""The whole GPU suite (``pytest -m "gpu or processes"``) in shards that each fit one device call,
and the merged table of what ran.

    python tools/gpu_suite.py plan  [--shards N]                    # the shards, one line a test
    python tools/gpu_suite.py run   --out DIR [--shards N] [--only I ...] [--budget S] [-n K]
    python tools/gpu_suite.py merge DIR [DIR ...] [--markdown]

Order: the tests are interleaved across files (the first test of every file, then the second, ...),
and the shards are consecutive slices of that order, so any prefix of the shards covers every
file, and with it every kernel family, transport and token layout the files stand for, before it
repeats one. ``run`` runs its shards in turn, in this process (pytest with pytest-xdist's ``-n K``
workers when K > 1), and for shard I writes, as it goes: ``DIR/shard-I.ids`` (the planned node
ids, before the first test), ``DIR/shard-I.log`` (one line per finished test, flushed: outcome,
seconds, node id, the reason of a skip or the last line of a failure) and ``DIR/shard-I.xml``
(JUnit, when the shard ends). A call cut short still leaves every finished test's line. ``--budget``
stops before a shard that the slowest shard so far says would not finish in the seconds left.
``merge`` reads the three files of every shard under the given folders and prints one row a test
file: passed, failed, skipped, not run (planned but no line), and the failures and skips with
their reasons; exit 1 when any test failed or did not run.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = "gpu or processes"
SHARDS = 6


def collect() -> list[str]:
    """Every GPU test's node id, in collection order (no GPU needed to collect)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", MARKERS, "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode not in (0, 5) or not ids:
        raise SystemExit(f"collection failed (exit {out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return ids


def interleave(ids: list[str]) -> list[str]:
    """Round-robin over the test files, each file's tests in their own order."""
    files: dict[str, collections.deque] = {}
    for i in ids:
        files.setdefault(i.split("::")[0], collections.deque()).append(i)
    out = []
    while files:
        for f in list(files):
            out.append(files[f].popleft())
            if not files[f]:
                del files[f]
    return out


def shards(ids: list[str], n: int) -> list[list[str]]:
    """``n`` consecutive slices of the interleaved order, sizes differing by at most one."""
    if n < 1:
        raise SystemExit(f"--shards must be >= 1, got {n}")
    order = interleave(ids)
    size, extra = divmod(len(order), n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + size + (i < extra))
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


class LineLog:
    """pytest plugin: one flushed line per finished test (xdist reports reach the controller too)."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def pytest_runtest_logreport(self, report):
        failed_setup = report.when == "setup" and not report.passed
        if report.when != "call" and not failed_setup and not (report.when == "teardown" and report.failed):
            return
        if report.skipped:
            outcome, why = "skipped", str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        elif report.failed:
            outcome = "failed" if report.when == "call" else f"error-{report.when}"
            why = str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""
        else:
            outcome, why = "passed", ""
        self.file.write(f"{outcome}\t{report.duration:.1f}\t{report.nodeid}\t{why}\n")

    def pytest_unconfigure(self, config):
        self.file.close()


def run(args) -> int:
    import pytest

    out = Path(args.out).resolve()  # before the chdir: relative to where the command runs
    os.chdir(ROOT)  # the node ids are relative to the repository root
    out.mkdir(parents=True, exist_ok=True)
    ids = collect()
    if args.shards > len(ids):
        raise SystemExit(f"--shards {args.shards}: at most one shard per GPU test ({len(ids)})")
    plan = shards(ids, args.shards)
    start, slowest, worst = time.monotonic(), 0.0, 0
    for i in args.only if args.only else range(len(plan)):
        left = args.budget - (time.monotonic() - start)
        if slowest and left < slowest:
            print(f"shard {i}: not started, {left:.0f} s left of the budget and a shard took {slowest:.0f} s", flush=True)
            continue
        (out / f"shard-{i}.ids").write_text("\n".join(plan[i]) + "\n")
        t0 = time.monotonic()
        print(f"=== shard {i}/{len(plan)}: {len(plan[i])} tests, {time.strftime('%H:%M:%S')}", flush=True)
        argv = ["-q", "-rfEs", "-p", "no:cacheprovider", "--junitxml", str(out / f"shard-{i}.xml"), *plan[i]]
        if args.workers > 1:
            if not importlib.util.find_spec("xdist"):
                raise SystemExit(f"-n {args.workers}: needs pytest-xdist (pip install pytest-xdist), or pass -n 1")
            argv[:0] = ["-n", str(args.workers)]
        if importlib.util.find_spec("pytest_timeout"):  # a hung test fails with its stack instead of eating the call
            argv[:0] = ["--timeout", str(args.test_timeout)]
        code = pytest.main(argv, plugins=[LineLog(out / f"shard-{i}.log")])
        slowest = max(slowest, time.monotonic() - t0)
        print(f"=== shard {i}: exit {int(code)}, {time.monotonic() - t0:.0f} s", flush=True)
        worst = max(worst, int(code))
    return worst


def merge(args) -> int:
    planned, seen, seconds = {}, {}, 0.0
    for d in args.dirs:
        found = sorted(Path(d).glob("shard-*.ids"))
        if not found:
            raise SystemExit(f"{d}: no shard-*.ids (not a folder `run` wrote)")
        for ids in found:
            for i in ids.read_text().split():
                planned[i] = None
            log = ids.with_suffix(".log")
            if log.exists():
                for line in log.read_text(errors="replace").splitlines():
                    fields = line.split("\t")
                    if len(fields) < 3 or fields[2] not in planned:  # a line the cut call left half-written
                        continue
                    seen[fields[2]] = (fields[0], fields[3] if len(fields) > 3 else "")
                    seconds += float(fields[1]) if fields[1].replace(".", "", 1).isdigit() else 0.0
    rows: dict[str, collections.Counter] = {}
    for node in planned:
        outcome = seen.get(node, ("not run", ""))[0]
        rows.setdefault(node.split("::")[0], collections.Counter())["failed" if outcome.startswith(("failed", "error")) else outcome] += 1
    cols = ("passed", "failed", "skipped", "not run")
    md = args.markdown
    head = ("| file | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols)) if md else \
        f"{'file':<48}" + "".join(f"{c:>9}" for c in cols)
    print(head)
    total = collections.Counter()
    for f in sorted(rows):
        total.update(rows[f])
        print(("| " + f + " | " + " | ".join(str(rows[f][c]) for c in cols) + " |") if md else
              f"{f:<48}" + "".join(f"{rows[f][c]:>9}" for c in cols))
    print(("| **all** | " + " | ".join(str(total[c]) for c in cols) + " |") if md else
          f"{'all':<48}" + "".join(f"{total[c]:>9}" for c in cols))
    print(f"\n{len(planned)} planned, test time {seconds:.0f} s (summed over tests; with -n K workers the wall time is less)")
    for node, (outcome, why) in seen.items():
        if node in planned and outcome != "passed":
            print(f"{outcome}: {node}: {why}")
    return 1 if total["failed"] or total["not run"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    pl = sub.add_parser("plan", help="print the shards")
    pl.add_argument("--shards", type=int, default=SHARDS)
    r = sub.add_parser("run", help="run shards, logging every test as it finishes")
    r.add_argument("--out", default=os.environ.get("OUT"), required="OUT" not in os.environ,
                   help="folder for the shard files (default $OUT)")
    r.add_argument("--shards", type=int, default=SHARDS)
    r.add_argument("--only", type=int, nargs="+", help="shard indices to run (default all, in order)")
    r.add_argument("--budget", type=float, default=float("inf"), help="seconds: start no shard that would not fit")
    r.add_argument("--test-timeout", type=float, default=300, help="seconds a test may take (pytest-timeout, where installed)")
    r.add_argument("-n", "--workers", type=int, default=4, help="pytest-xdist workers (1: none)")
    m = sub.add_parser("merge", help="one table from shard folders")
    m.add_argument("dirs", nargs="+")
    m.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if args.verb == "plan":
        for i, s in enumerate(shards(collect(), args.shards)):
            for node in s:
                print(f"{i}\t{node}")
        return 0
    if getattr(args, "shards", 1) < 1:
        p.error(f"--shards {args.shards}: must be at least 1")
    if args.verb == "run" and args.only and not all(0 <= i < args.shards for i in args.only):
        p.error(f"--only {args.only}: each shard index must be in [0, {args.shards})")
    return run(args) if args.verb == "run" else merge(args)


if __name__ == "__main__":
    sys.exit(main())
