"""Tables for replay results: one config in detail, or several configs side by side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ngramspec.drafting.protocol import Drafter
from ngramspec.policy.cost import StepCost
from ngramspec.simulator.replay import Report, Stream, Summary, simulate


def compare(drafter_factories: dict[str, Callable[[], Drafter]], streams: list[Stream],
            budget: int = 11, concurrency: int = 1, console: Console | None = None,
            reset_between_files: bool = False, cost: StepCost | None = None
            ) -> dict[str, Report]:
    """Replay the same streams through a fresh drafter per config and print a comparison."""
    reports = {name: simulate(make(), streams, budget, concurrency, reset_between_files, cost)
               for name, make in drafter_factories.items()}
    print_comparison(reports, console or Console())
    return reports


def _acc(s: Summary | None) -> str:
    return f"{s.mean_accepted:.2f}" if s and s.steps else "-"


def _speedup(s: Summary | None) -> str:
    return f"{s.modelled_speedup:.2f}x" if s and s.modelled_speedup is not None else "-"


def _sources(s: Summary) -> str:
    return " ".join(f"{name} {e['accepted']:.0f}/{e['drafted']:.0f}"
                    for name, e in s.by_source.items())


def print_comparison(reports: dict[str, Report], console: Console) -> None:
    first = next(iter(reports.values()))
    files = list(first.by_file)
    table = Table(title="mean accepted tokens per verify step (bonus included)")
    table.add_column("config")
    table.add_column("all", justify="right")
    table.add_column("no loops", justify="right")
    for f in files:
        table.add_column(Path(f).stem, justify="right")
    for column in ("modelled speed-up", "steps", "propose µs", "commit µs",
                   "accepted/drafted by source"):
        table.add_column(column, justify="right")
    for name, r in reports.items():
        table.add_row(name, _acc(r.overall), _acc(r.overall_no_loops),
                      *[_acc(r.by_file.get(f)) for f in files], _speedup(r.overall),
                      str(r.overall.steps),
                      f"{r.overall.propose_us:.1f}", f"{r.overall.commit_us:.1f}",
                      _sources(r.overall))
    console.print(table)
    by_cat = Table(title="mean accepted by category (looping streams excluded)")
    by_cat.add_column("category")
    for name in reports:
        by_cat.add_column(name, justify="right")
    for cat in sorted(first.by_category):
        by_cat.add_row(cat, *[_acc(r.by_category_no_loops.get(cat)) for r in reports.values()])
    console.print(by_cat)
    if first.looping_ids:
        console.print(f"looping streams ({len(first.looping_ids)}): {', '.join(first.looping_ids)}")


def print_report(report: Report, console: Console, title: str = "replay") -> None:
    """One config: per file and per category, with and without looping streams."""
    table = Table(title=f"{title}: mean accepted tokens per verify step (bonus included)")
    for column in ("group", "requests", "steps", "tokens", "mean acc", "no loops",
                   "modelled speed-up", "propose µs", "commit µs", "accepted/drafted by source"):
        table.add_column(column, justify="left" if column == "group" else "right")
    rows = [("all", report.overall, report.overall_no_loops)]
    rows += [(Path(f).name, s, report.by_file_no_loops.get(f)) for f, s in report.by_file.items()]
    rows += [(f"  {c}", s, report.by_category_no_loops.get(c))
             for c, s in sorted(report.by_category.items())]
    for name, s, clean in rows:
        table.add_row(name, str(s.requests), str(s.steps), str(s.tokens), _acc(s), _acc(clean),
                      _speedup(s), f"{s.propose_us:.1f}", f"{s.commit_us:.1f}", _sources(s))
    console.print(table)
    if report.looping_ids:
        console.print(f"looping streams ({len(report.looping_ids)}): "
                      f"{', '.join(report.looping_ids)}")
