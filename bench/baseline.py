"""The baseline the online targets are judged against: an older commit of this repository, checked
out for the run as a detached git worktree under the run's temporary directory, and removed after.

A checkout that fails (no git, a shallow clone without the commit) is not an error of the run: the
scenario goes on without the baseline, and the verdicts that need it read "not measurable".
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bench.harness import ROOT, fresh_database, say

if TYPE_CHECKING:  # the bench's own modules start without the platform's imports
    from inference.spec import LoadedSpec

GIT_TIMEOUT_S = 120.0
COPY_CHUNK_ROWS = 20_000


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


def head_revision(checkout: Path) -> str:
    """The newest migration in `checkout`: the schema its code reads and writes."""
    versions = sorted((checkout / "inference" / "migrations" / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))
    return versions[-1].name[:4]


def database(ls: LoadedSpec, source_url: str, checkout: Path, parent: Path) -> tuple[str, Callable[[], None]]:
    """A fresh database (`fresh_database`) holding `copy_records`' copy; its URL and how to drop it."""
    url, drop = fresh_database(parent)
    try:
        copy_records(ls, source_url, url, checkout)
    except BaseException:
        drop()
        raise
    return url, drop


def copy_records(ls: LoadedSpec, source_url: str, target_url: str, checkout: Path) -> None:
    """`target_url` made a database for the baseline's code: the core tables at its own head
    revision (the migrations are frozen, so this checkout's reach it) and the records of
    `source_url`'s record table copied in. On this checkout's database a core table renamed since
    (0008's record_id) fails the baseline's queries."""
    import sqlalchemy as sa

    from inference.migrate import upgrade_core
    from inference.store import make_engine

    revision = head_revision(checkout)
    target, source = make_engine(target_url), make_engine(source_url)
    try:
        upgrade_core(target, revision)
        theirs = sa.Table(ls.table, sa.MetaData(), autoload_with=target)
        ours = sa.Table(ls.table, sa.MetaData(), autoload_with=source)
        with source.connect() as read, target.begin() as write:
            rows = read.execute(sa.select(*(ours.c[column.name] for column in theirs.columns))).mappings()
            while chunk := rows.fetchmany(COPY_CHUNK_ROWS):
                write.execute(theirs.insert(), [dict(row) for row in chunk])
    finally:
        target.dispose()
        source.dispose()
    say(f"baseline database {target_url}: {ls.table} copied, core tables at {revision}")
