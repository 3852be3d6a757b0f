"""Where bench files go: a bare name into the git-ignored bench-out/, a path with a folder as given."""

import argparse
import subprocess
from pathlib import Path

from pagellm.bench.arguments import OUT_DIR, add_output_arguments

REPO = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_output_arguments(p, "batched", "rows", "plot")
    return p


def test_a_bare_name_goes_to_the_ignored_folder_and_a_folder_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parser().parse_args(["--out", "rows.json", "--plot", str(tmp_path / "b.png")])
    assert args.out == OUT_DIR / "rows.json"
    assert args.plot == tmp_path / "b.png"
    assert parser().parse_args(["--out", "./rows.json"]).out == Path("rows.json")  # a folder named: kept
    assert not (tmp_path / OUT_DIR).exists()  # parsing writes nothing


def test_flags_without_a_value_name_the_file_by_command_and_time():
    args = parser().parse_args(["--out", "--plot"])
    assert args.out.parent == OUT_DIR and args.out.name.startswith("batched-") and args.out.suffix == ".json"
    assert args.plot.parent == OUT_DIR and args.plot.suffix == ".png"
    assert parser().parse_args([]).out is None


def test_git_ignores_the_bench_folder():
    probe = f"{OUT_DIR}/any-run.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO)
    assert ignored.returncode == 0, f"{probe} would be tracked: add /{OUT_DIR}/ to .gitignore"
