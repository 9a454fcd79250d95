"""The baseline of the online comparison is an older commit checked out for the run: a worktree
that exists while the run needs it and is gone after, or, where it cannot be made, the reason."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.baseline import checkout


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def repository(path: Path) -> str:
    """A repository with one commit; returns the commit."""
    path.mkdir()
    git(path, "init", "--quiet")
    (path / "serving.py").write_text("OLD = True\n")
    git(path, "add", "serving.py")
    git(path, "-c", "user.name=bench", "-c", "user.email=bench@example.com", "commit", "--quiet", "-m", "old")
    return git(path, "rev-parse", "HEAD").strip()


def test_the_commit_is_checked_out_for_the_run_and_removed_after(tmp_path: Path) -> None:
    commit = repository(tmp_path / "repo")
    with checkout(commit[:7], tmp_path / "run", tmp_path / "repo") as found:
        assert isinstance(found, Path)
        assert (found / "serving.py").read_text() == "OLD = True\n"
    assert not found.exists()
    assert git(tmp_path / "repo", "worktree", "list").count("\n") == 1  # the repository's own only


def test_a_commit_that_cannot_be_checked_out_is_a_reason_not_an_error(tmp_path: Path) -> None:
    repository(tmp_path / "repo")
    with checkout("972a628", tmp_path / "run", tmp_path / "repo") as found:
        assert isinstance(found, str)
        assert found.startswith("972a628 could not be checked out")
    assert not (tmp_path / "run").exists()
