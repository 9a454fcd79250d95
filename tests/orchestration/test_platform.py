"""The `make run` launcher (orchestration/platform.py): what its exit status says."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestration import platform


@pytest.mark.parametrize(("failed", "code"), [(0, 0), (3, 1)])
def test_no_serve_exits_non_zero_when_a_demo_run_failed(
    failed: int, code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It exited 0 after five failed runs: a script or CI took the demo for working.
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setattr(platform, "materialize_demo", lambda settings: failed)
    monkeypatch.setattr(platform, "serve_forever", lambda: pytest.fail("--no-serve served"))

    assert platform.main(["--no-serve"]) == code
    said = capsys.readouterr().out
    assert ("3 demo run(s) failed" in said) is bool(failed)
