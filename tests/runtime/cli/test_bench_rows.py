"""The benchmark's rows: combine counts the rows a rank's combine gathers for its tokens; the CSV
says which time is queued behind a GPU-side delay and which host-launched, which kernel family ran
and whether the ranks were virtual; the points each family is timed at; the plot of both."""

import csv
import statistics

import pytest
import torch

from epgen.codegen.spec import TIMED_OPS
from epgen.cli import bench
from epgen.cli.bench import op_row
from epgen.harness.measure import gathered_rows
from epgen.cli.options import BOTH_LOW_LATENCY_MAX_TOKENS, family_points
from epgen.harness.timing import Timing
from epgen.reference import dispatch


def test_gathered_rows_hand_worked():
    # W = 2, L = 2 (experts 0-1 on rank 0, 2-3 on rank 1); rank 0's tokens:
    #   t0 -> ranks 0 and 1; t1 -> rank 1 twice (one row); t2 -> no expert; t3 -> rank 0 only
    idx = torch.tensor([[0, 3], [2, 3], [-1, -1], [1, -1]], dtype=torch.int32)
    assert gathered_rows(idx, 2, 2, 0) == (4, 2)  # rows (t0 x2, t1, t3); from rank 1: t0, t1
    assert gathered_rows(idx, 2, 2, 1) == (4, 2)  # the same tokens on rank 1: rows on rank 0 are t0, t3
    assert gathered_rows(idx[:0], 2, 2, 0) == (0, 0)


def test_gathered_rows_sum_to_the_dispatch_rows_under_skew():
    """Summed over ranks, the combine's gathered rows are the dispatch's received rows (all and
    from other ranks), while per rank they differ when one rank receives most rows."""
    W, L, K, H = 4, 3, 4, 8
    gen = torch.Generator().manual_seed(5)
    tokens = [7, 0, 12, 5]
    idx = []
    for T in tokens:
        ids = torch.randint(0, W * L, (T, K), generator=gen, dtype=torch.int32)
        ids[: T // 2] = torch.randint(0, L, (T // 2, K), generator=gen, dtype=torch.int32)  # half to rank 0
        ids[ids % 5 == 0] = -1
        idx.append(ids)
    xs = [torch.randn(T, H) for T in tokens]
    ws = [torch.rand(T, K) for T in tokens]
    recv = dispatch(xs, ws, idx, experts_per_rank=L)
    got = [gathered_rows(idx[r], L, W, r) for r in range(W)]
    recv_all = [r.x.shape[0] for r in recv]
    recv_wire = [int((r.src[:, 0] != d).sum()) for d, r in enumerate(recv)]
    assert sum(g[0] for g in got) == sum(recv_all)
    assert sum(g[1] for g in got) == sum(recv_wire)
    assert [g[0] for g in got] != recv_all  # skew: rank 0 received more than its combine gathers


@pytest.mark.parametrize("rank", [-1, 2, 5, None, True, 1.0, "0"])
def test_gathered_rows_rejects_a_rank_outside_the_world(rank):
    idx = torch.tensor([[0, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"rank=.*: must be an int in \[0, world_size=2\)"):
        gathered_rows(idx, 2, 2, rank)


def _rows(method, family="normal", virtual=False, tokens=1, op="dispatch", routing="uniform", us=(8.0, 9.0, 8.5, 30.0)):
    from epgen.codegen.config import Geometry

    queued, host = Timing(us), Timing((11.0, 10.5, 10.0, 12.0))
    return [op_row(op, "bf16", routing, tokens, 0, 1, queued, host, method, rows_all=8, rows_wire=8,
                   row_bytes=14_336, wire_row_bytes=14_336, ceil_gbps=100.0, nccl_gbps=float("nan"),
                   geo=Geometry(24, 32, 4), family=family, virtual=virtual)]


def test_the_csv_says_which_time_is_queued_and_which_host_launched(tmp_path, monkeypatch, capsys):
    plotted = []
    monkeypatch.setattr(bench, "_plot", lambda rows, path: plotted.append((rows, path)))
    rows = _rows(bench.QUEUED) + _rows(bench.SHORT_SLEEP)
    bench.write_results(rows, str(tmp_path / "b"), env={"gpu": "test"})
    with open(tmp_path / "b.csv", newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == bench.CSV_COLUMNS
    assert header.index("host_launched_us") == header.index("best_us") + 1 and "timing" in header
    back = bench.read_csv(str(tmp_path / "b.csv"))
    assert [r["timing"] for r in back] == ["queued", "queued-short-sleep"]
    r = back[0]
    # time_us, mean, stdev, best and the bandwidths come from the queued samples; host_launched_us is the other median
    assert (r["time_us"], r["mean_us"], r["best_us"], r["host_launched_us"]) == (8.75, 13.88, 8.0, 10.75)
    assert r["stdev_us"] == round(statistics.stdev((8.0, 9.0, 8.5, 30.0)), 2)
    assert r["wire_gbps"] == round(8 * 14_336 / 8.75 / 1e3, 1) and r["ratio_ceiling"] == round(r["wire_gbps"] / 100, 3)
    assert plotted == [(rows, str(tmp_path / "b.png"))]
    table = capsys.readouterr().out
    assert "queued us" in table and "host-launched us" in table and "queued-short-sleep" in table


def test_the_csv_and_the_table_carry_the_family_and_the_virtual_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_plot", lambda rows, path: None)
    rows = _rows(bench.QUEUED) + _rows(bench.QUEUED, family="low_latency", virtual=True)
    bench.write_results(rows, str(tmp_path / "b"), env={"gpu": "test"})
    header = bench.CSV_COLUMNS
    assert header[:2] == ("op", "family") and header[header.index("world_size") + 1] == "virtual"
    back = bench.read_csv(str(tmp_path / "b.csv"))
    assert [(r["family"], r["virtual"]) for r in back] == [("normal", False), ("low_latency", True)]
    assert [type(r["virtual"]) for r in back] == [bool, bool]
    table = capsys.readouterr().out
    assert "family" in table and "virtual" in table and "low_latency" in table
    cells = [[c.strip() for c in line.split("│")[2:4]] for line in table.splitlines() if "dispatch" in line]
    assert cells == [["normal", "no"], ["low_latency", "yes"]]


def test_a_row_names_a_family_the_bench_knows():
    with pytest.raises(ValueError, match=r"family='auto': must be one of normal, low_latency"):
        _rows(bench.QUEUED, family="auto")


def test_family_points_both_times_the_low_latency_family_at_decode_sizes_only():
    tokens = (1, 8, 1024, 1025, 16384, 8)
    assert family_points("both", tokens) == {"normal": (1, 8, 1024, 1025, 16384),
                                             "low_latency": (1, 8, BOTH_LOW_LATENCY_MAX_TOKENS)}
    assert family_points("both", (4096, 8192)) == {"normal": (4096, 8192)}  # no count small enough
    for family in ("normal", "low_latency", "auto"):
        assert family_points(family, tokens) == {family: (1, 8, 1024, 1025, 16384)}  # every count asked for
    with pytest.raises(ValueError, match=r"family='fast': must be one of both, auto, normal, low_latency"):
        family_points("fast", tokens)


def test_the_plot_draws_both_families_in_their_own_line_styles():
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra (pip install -e '.[bench]')")
    rows = []
    for routing in ("uniform", "skewed"):
        for op in ("dispatch", "combine"):
            for T in (1, 128, 4096):
                rows += _rows(bench.QUEUED, tokens=T, op=op, routing=routing, us=(T / 10 + 5,) * 4)
                if T <= BOTH_LOW_LATENCY_MAX_TOKENS:
                    rows += _rows(bench.QUEUED, family="low_latency", tokens=T, op=op, routing=routing, us=(4.0,) * 4)
    fig = bench.figure(rows)
    ax_bw, ax_t = fig.axes
    for ax in (ax_bw, ax_t):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for routing in ("uniform", "skewed"):
            for op in ("dispatch", "combine"):
                suffix = "" if ax is ax_bw else ", queued"
                normal, ll = lines[f"{op} normal ({routing}){suffix}"], lines[f"{op} low_latency ({routing}){suffix}"]
                assert (normal.get_linestyle(), ll.get_linestyle()) == ("-", "--")
                assert (normal.get_marker(), ll.get_marker()) == ("o", "s")
                assert normal.get_color() == ll.get_color()  # one colour per (op, routing)
                assert list(normal.get_xdata()) == [1, 128, 4096] and list(ll.get_xdata()) == [1, 128]
    host = [line for line in ax_t.get_lines() if line.get_label().endswith("host-launched")]
    assert len(host) == 8 and {line.get_linestyle() for line in host} == {":"}
    ceiling = [line for line in ax_bw.get_lines() if line.get_label().startswith("P2P ceiling")]
    assert len(ceiling) == 1 and list(ceiling[0].get_xdata()) == [1, 128, 4096]  # one figure a point
    colours = {lines.get_color() for lines in ax_t.get_lines() if "queued" in lines.get_label()}
    assert len(colours) == 4


def test_the_png_is_written_with_both_families(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra (pip install -e '.[bench]')")
    rows = _rows(bench.QUEUED) + _rows(bench.QUEUED, family="low_latency")
    bench.write_results(rows, str(tmp_path / "b"), quiet=True, env={"gpu": "test"})
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FakeOp:
    """Stands in for EpDispatchCombine in bench_process: one rank, a family per token count as
    its config says (auto: low-latency up to 128 tokens), 8 rows received from a peer."""

    built = []

    def __init__(self, cfg, virtual=False):
        import types

        from epgen.codegen.config import Geometry

        self.config, self.virtual = cfg, virtual
        self.local_ranks, self.arch, self.device = [0], "sm_90", torch.device("cpu")
        self.arenas = types.SimpleNamespace(pointers={0: 0, 1: 0})
        self.arena_layout = types.SimpleNamespace(recv_x=0, combine_in=0)
        self.dispatch_spec = types.SimpleNamespace(row_bytes=cfg.hidden * 2)
        self.geometries = {"normal": Geometry(24, 32, 4), "low_latency": Geometry(32, 16, 2)}
        self.closed = False
        _FakeOp.built.append(self)

    def family(self, tokens):
        kind = self.config.kernel_family
        return ("low_latency" if tokens <= 128 else "normal") if kind == "auto" else kind

    def variant(self, op, tokens):
        assert op in TIMED_OPS[self.family(tokens)], (op, tokens)
        return self.geometries[self.family(tokens)]

    def recv_buffers(self, rank):
        import types

        return types.SimpleNamespace(num_recv=torch.tensor([8]), recv_src=torch.ones(8, 2, dtype=torch.int32))

    def close(self):
        self.closed = True


@pytest.fixture
def fake_bench(monkeypatch):
    """bench_process on the CPU: fake ops, measure, ceiling and environment; records the
    (kernel family, tokens) of every measure call."""
    import epgen.op
    from epgen.harness.timing import PairTiming, QueueDelay

    _FakeOp.built = []
    calls = []

    def measure(op, cfg, tokens, routing, seed, iters):
        calls.append((cfg.kernel_family, tokens, seed))
        us = 5.0 if op.family(tokens) == "low_latency" else 20.0
        t = Timing((us, us))
        transport = "pull" if cfg.dispatch_transport == "pull" else "push"
        return PairTiming(queued=(t, t), host=(t, t), delay=QueueDelay(100.0, 10.0, True)), (8, 4), transport

    monkeypatch.setattr(epgen.op, "EpDispatchCombine", _FakeOp)
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "_Ceiling", lambda arch, device: type("C", (), {"run": lambda *a: None})())
    monkeypatch.setattr(bench, "_time", lambda fn, iters, queued=True: (Timing((10.0,)), True))
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "test"})
    return calls


def _layer(world_size: int, **kw):
    """The layer bench takes from the command line: deepseek-v3 at ``world_size`` ranks."""
    from epgen.codegen.config import EpConfig

    return EpConfig.for_model("deepseek-v3", world_size=world_size, max_tokens_per_rank=4096, **kw)


def test_bench_times_each_point_on_every_family_that_covers_it(fake_bench, capsys):
    from epgen.cli.options import BenchOptions

    opts = BenchOptions(virtual=True, tokens=(1, 1024, 4096), routings=("uniform",), iters=3)
    rows = bench.bench_process(0, 2, _layer(2), opts)
    assert [(op.config.kernel_family, op.config.max_tokens_per_rank, op.virtual) for op in _FakeOp.built] == [
        ("normal", 4096, True), ("low_latency", 1024, True)]
    assert [c[:2] for c in fake_bench] == [("normal", 1), ("low_latency", 1), ("normal", 1024), ("low_latency", 1024),
                                           ("normal", 4096)]
    assert fake_bench[0][2] == fake_bench[1][2] != fake_bench[2][2]  # one point, the same inputs for both families
    assert [(r["op"], r["family"], r["tokens"]) for r in rows] == [
        ("dispatch", "normal", 1), ("combine", "normal", 1), ("dispatch", "low_latency", 1),
        ("combine", "low_latency", 1), ("dispatch", "normal", 1024), ("combine", "normal", 1024),
        ("dispatch", "low_latency", 1024), ("combine", "low_latency", 1024), ("dispatch", "normal", 4096),
        ("combine", "normal", 4096)]
    assert all(r["virtual"] for r in rows)
    assert {(r["family"], r["blocks"], r["warps_per_block"], r["unroll"]) for r in rows} == {
        ("normal", 24, 32, 4), ("low_latency", 32, 16, 2)}
    assert {r["p2p_ceiling_gbps"] for r in rows if r["tokens"] == 1} == {round(8 * 7168 * 2 / 10.0 / 1e3, 1)}
    assert all(op.closed for op in _FakeOp.built)
    out = capsys.readouterr().out
    assert "bench uniform 1 tokens, normal (queued" in out and "bench uniform 1 tokens, low_latency (queued" in out


def test_bench_transport_goes_to_the_normal_family_and_its_dispatch_rows(fake_bench, capsys):
    """--transport pull: the normal op's EpConfig pulls, the low-latency op's pushes (it has no
    pull); the dispatch rows name the transport taken, the combine rows none."""
    from epgen.cli.options import BenchOptions

    rows = bench.bench_process(0, 2, _layer(2, dispatch_transport="pull"),
                               BenchOptions(virtual=True, tokens=(8, 4096), routings=("uniform",)))
    assert [(op.config.kernel_family, op.config.dispatch_transport) for op in _FakeOp.built] == [
        ("normal", "pull"), ("low_latency", "push")]
    assert [(r["op"], r["family"], r["transport"]) for r in rows if r["tokens"] == 8] == [
        ("dispatch", "normal", "pull"), ("combine", "normal", ""), ("dispatch", "low_latency", "push"),
        ("combine", "low_latency", "")]


def test_bench_auto_rows_name_the_family_each_point_took(fake_bench):
    from epgen.cli.options import BenchOptions

    rows = bench.bench_process(0, 1, _layer(1), BenchOptions(tokens=(8, 4096), routings=("uniform",), family="auto"))
    assert [op.config.kernel_family for op in _FakeOp.built] == ["auto"]
    assert [(r["family"], r["tokens"], r["blocks"]) for r in rows] == [
        ("low_latency", 8, 32), ("low_latency", 8, 32), ("normal", 4096, 24), ("normal", 4096, 24)]
    assert not any(r["virtual"] for r in rows)
