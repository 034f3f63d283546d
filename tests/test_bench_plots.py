"""bench/README.md's figures: regenerated from the committed results, all of them shown.

``python -m bench.plots`` draws ``bench/figures/*.png`` from ``bench/results/*.json``; these
tests draw them again into a temporary directory (matplotlib Agg) and check that every figure
the README embeds exists, is one the plots module draws, and that the fleet table the recorded
results give is the one quoted (in bench/HISTORY.md, the dated recordings).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import plots  # noqa: E402
from bench.common import FIGURES_DIR, RESULTS_DIR  # noqa: E402

README = REPO / "bench" / "README.md"
HISTORY = REPO / "bench" / "HISTORY.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_figure_regenerates_from_the_committed_results(tmp_path: Path) -> None:
    written = plots.draw(RESULTS_DIR, tmp_path)
    assert {"fanout", "fanout-memory", "serving", "throughput", "freshness"} <= {
        p.stem for p in written
    }
    # what the README shows is exactly what the committed results draw
    assert sorted(p.name for p in written) == sorted(
        Path(f).name for f in plots.readme_figures(README)
    )
    for p in written:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, p


def test_every_figure_in_the_readme_is_committed_and_drawn() -> None:
    shown = plots.readme_figures(README)
    assert shown, "bench/README.md embeds no figure"
    assert {Path(f).stem for f in shown} <= set(plots.FIGURES)
    for f in shown:
        path = README.parent / f
        assert path.exists(), f"bench/README.md shows {f}, which is not committed"
        assert path.read_bytes().startswith(PNG_MAGIC)
    committed = {p.name for p in FIGURES_DIR.glob("*.png")}
    assert committed == {Path(f).name for f in shown}, "a committed figure the README omits"


def test_the_quoted_tables_are_the_recorded_ones() -> None:
    """The fleet table and the scale model's table, as bench.plots prints them from the
    committed results, are in bench/HISTORY.md (the dated recordings) line for line."""
    table = plots.fleet_table(RESULTS_DIR)
    model = plots.model_table(RESULTS_DIR)
    assert len(table) > 2 and len(model) > 2
    text = HISTORY.read_text()
    for line in [*table, *model]:
        assert line in text, f"bench/HISTORY.md lacks the recorded row:\n{line}"


def test_every_recorded_result_says_where_it_comes_from() -> None:
    for path in RESULTS_DIR.glob("*.json"):
        doc = json.loads(path.read_text())
        assert doc.get("source"), path.name
        assert isinstance(doc.get("result"), dict), path.name


def test_a_figure_without_results_is_skipped_not_drawn_empty(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    assert plots.draw(results, tmp_path / "none") == []
    assert not list((tmp_path / "none").glob("*.png"))
    shutil.copy(RESULTS_DIR / "throughput.json", results)
    assert [p.name for p in plots.draw(results, tmp_path / "one")] == ["throughput.png"]


def test_record_writes_what_the_plots_read(tmp_path: Path) -> None:
    from bench.run import record

    fleet = plots.fleet_result(RESULTS_DIR)
    assert fleet is not None
    path = record("fanout", {"status": "ok", "fleet": fleet, "plots": ["x.png"]},
                  {"preset": "quick"}, tmp_path)  # fmt: skip
    doc = json.loads(path.read_text())
    assert doc["source"].startswith("deltad bench --record") and "plots" not in doc["result"]
    assert doc["meta"]["recorded_utc"] and doc["meta"]["loadavg_recorded"]
    # a recorded whole fan-out run serves the fleet figures too
    assert plots.fleet_table(tmp_path) == plots.fleet_table(RESULTS_DIR)


def test_record_refuses_tiny_results() -> None:
    from bench.run import add_arguments, run
    from deltad.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="--record"):
        run(parser.parse_args(["--tiny", "--record", "--only", "merge"]))
