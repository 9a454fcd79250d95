"""The baseline the online targets are judged against: an older commit of this repository, checked
out for the run as a detached git worktree under the run's temporary directory, and removed after.

A checkout that fails (no git, a shallow clone without the commit) is not an error of the run: the
scenario goes on without the baseline, and the verdicts that need it read "not measurable".
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from bench.harness import ROOT, say

GIT_TIMEOUT_S = 120.0


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
    )


@contextlib.contextmanager
def checkout(commit: str, parent: Path, repo: Path = ROOT) -> Iterator[Path | str]:
    """Yield the path of `commit`'s worktree of `repo` under `parent`, or why there is none."""
    path = parent / f"baseline-{commit}"
    try:
        _git(repo, "worktree", "prune")  # a killed run's worktree whose directory is gone
        _git(repo, "worktree", "add", "--detach", str(path), commit)
    except (OSError, subprocess.SubprocessError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip().splitlines() or [type(error).__name__]
        why = f"{commit} could not be checked out as a worktree: {detail[-1]}"
        say(why)
        yield why
        return
    say(f"baseline {commit} checked out at {path}")
    try:
        yield path
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _git(repo, "worktree", "remove", "--force", str(path))
