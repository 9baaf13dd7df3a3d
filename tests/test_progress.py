"""The one-time build announcements: estimate from the last build, nothing when nothing builds."""

from __future__ import annotations

import pytest

from ngramspec import progress


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NGRAMSPEC_CACHE", str(tmp_path))


def test_a_build_is_announced_and_its_time_becomes_the_next_estimate(capsys) -> None:
    assert progress.expected_seconds("thing", 77.0) == 77.0
    with progress.build_progress("the thing", "thing", 77.0):
        pass
    err = capsys.readouterr().err
    assert "building the thing" in err and "about 77 s" in err and "built in" in err
    assert progress.expected_seconds("thing", 77.0) < 5.0  # this build's time, not the default
    assert progress.expected_seconds("other", 3.0) == 3.0


def test_nothing_is_printed_when_nothing_builds(capsys) -> None:
    with progress.build_progress("the thing", "thing", 10.0, enabled=False):
        pass
    assert capsys.readouterr().err == ""
    assert progress.expected_seconds("thing", 10.0) == 10.0


def test_a_failed_build_says_so_and_keeps_the_old_estimate(capsys) -> None:
    with pytest.raises(RuntimeError):
        with progress.build_progress("the thing", "thing", 42.0):
            raise RuntimeError("compiler exploded")
    assert "the thing failed" in capsys.readouterr().err
    assert progress.expected_seconds("thing", 42.0) == 42.0


def test_a_corrupt_times_file_is_ignored(tmp_path) -> None:
    (tmp_path / "build_times.json").write_text("{not json")
    assert progress.expected_seconds("thing", 9.0) == 9.0
    with progress.build_progress("the thing", "thing", 9.0):
        pass
    assert progress.expected_seconds("thing", 9.0) < 5.0
