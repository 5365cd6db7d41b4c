"""tools/gpu_suite.py: the shards interleave the test files and cover every GPU test once; the
merged table counts passed, failed, skipped and not run from the shard files a cut call leaves."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "tools" / "gpu_suite.py")
gpu_suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_suite)

IDS = [f"tests/gpu/test_{f}.py::test_{i}" for f in "abc" for i in range(4 if f == "a" else 2)]


def test_shards_interleave_the_files_and_cover_every_test_once():
    shards = gpu_suite.shards(IDS, 3)
    assert sorted(i for s in shards for i in s) == sorted(IDS)
    assert [len(s) for s in shards] == [3, 3, 2]
    assert {i.split("::")[0] for i in shards[0]} == {f"tests/gpu/test_{f}.py" for f in "abc"}  # every file first


def test_merge_counts_what_ran_and_names_what_did_not(tmp_path, capsys):
    (tmp_path / "shard-0.ids").write_text("\n".join(IDS[:4]) + "\n")
    (tmp_path / "shard-0.log").write_text(f"passed\t1.0\t{IDS[0]}\t\nfailed\t2.0\t{IDS[1]}\tAssertionError: x\n"
                                          f"skipped\t0.0\t{IDS[2]}\tno GPU\n")  # IDS[3]: cut before it ran
    (tmp_path / "shard-1.ids").write_text("\n".join(IDS[4:]) + "\n")  # a shard never started: no log
    code = gpu_suite.main(["merge", str(tmp_path)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tests/gpu/test_a.py"))
    assert row.split()[1:] == ["1", "1", "1", "1"]
    assert next(line for line in out.splitlines() if line.startswith("all")).split()[1:] == ["1", "1", "1", "5"]
    assert "failed: tests/gpu/test_a.py::test_1: AssertionError: x" in out and code == 1


def test_merge_refuses_a_folder_without_shards_and_skips_a_half_written_line(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit, match="no shard-"):
        gpu_suite.main(["merge", str(tmp_path)])
    (tmp_path / "shard-0.ids").write_text(IDS[0] + "\n" + IDS[1] + "\n")
    (tmp_path / "shard-0.log").write_bytes(f"passed\t1.0\t{IDS[0]}\t\nskipped\t0.".encode() + b"\xff")
    assert gpu_suite.main(["merge", str(tmp_path)]) == 1  # IDS[1] not run
    assert next(line for line in capsys.readouterr().out.splitlines() if line.startswith("all")).split()[1:] == \
        ["1", "0", "0", "1"]


def test_run_refuses_bad_shard_arguments_before_collecting():
    import pytest

    for argv, match in ((["--shards", "0"], "must be at least 1"), (["--shards", "2", "--only", "2"], r"in \[0, 2\)")):
        with pytest.raises(SystemExit):
            gpu_suite.main(["run", "--out", "x", *argv])
