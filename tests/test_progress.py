"""placement.progress: when a bar is drawn, and that it counts the work either way."""

from __future__ import annotations

import io

import pytest

from placement.progress import ENV_VAR, progress, progress_enabled


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert progress_enabled(stream=_Tty())
    assert not progress_enabled(stream=io.StringIO())
    assert not progress_enabled(stream=_Tty(), quiet=True)


@pytest.mark.parametrize(("value", "tty", "expected"), [("1", False, True), ("0", True, False), ("", False, False)])
def test_the_environment_variable_overrides_the_terminal_test(
    monkeypatch: pytest.MonkeyPatch, value: str, tty: bool, expected: bool
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    assert progress_enabled(stream=_Tty() if tty else io.StringIO()) is expected
    assert not progress_enabled(stream=_Tty(), quiet=True)  # --quiet wins over the variable


def test_a_drawn_bar_shows_the_work_and_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    with progress(4, "solve: layers", "layer", stream=out) as bar:
        assert bar.active
        for _ in range(4):
            bar.update()
        bar.write("a note")
    text = out.getvalue()
    assert "solve: layers" in text and "4/4" in text and "a note" in text
    assert bar.n == 4


def test_a_quiet_bar_draws_nothing_and_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    with progress(None, "import: bytes read", "B", unit_scale=True, quiet=True, stream=out) as bar:
        bar.update(1000)
        bar.set_total(2000)
        bar.update(1000)
        bar.write("not shown")
    assert out.getvalue() == ""
    assert (bar.n, bar.total, bar.active) == (2000, 2000, False)


def test_report_takes_absolute_figures_as_library_callbacks_give_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    out = io.StringIO()
    with progress(None, "plan: candidates", "candidate", stream=out) as bar:
        bar.report(2, 10)
        bar.report(7, 10)
        bar.report(7, 12)  # the total may change as the work learns more
    assert (bar.n, bar.total) == (7, 12)
    assert "7/12" in out.getvalue()
