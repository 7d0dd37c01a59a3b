"""The planner on the reported GLM-5.3-Flash layout, term by term, held to the table in
packages/offload/README.md ("The reported figures"), so that any change of the planner's terms shows up here
and in that table together.

The table's predictions are read from the README and recomputed; the peaks are also pinned here, beside the
reported figures they fall short of (the README says which terms are unknown)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megaseq.config import load_recipe
from megaseq.distributed.layout import Layout
from megaseq.memory.machine import GiB, Machine
from megaseq.memory.plan import Estimate, plan
from megaseq.plugins import get_plugins

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "packages" / "offload" / "README.md"
# the README table's columns: (seq_len, candidate)
# (the recipe's re-runs select their top-k again: reuse_kept = false, its comment says why)
COLUMNS = [(2**20, "offload + recompute(reuse_kept=False)"), (2**18, "recompute(reuse_kept=False)"),
           (2**18, "offload + recompute(reuse_kept=False)")]
# the predicted peaks (GiB) and the reported ones
PEAKS = {COLUMNS[0]: (109.40, 144.5), COLUMNS[1]: (94.24, 142.0), COLUMNS[2]: (88.99, 98.0)}


@pytest.fixture(scope="module")
def estimates() -> dict[tuple[int, str], Estimate]:
    plugins = get_plugins()
    recipe = load_recipe(str(ROOT / "recipes" / "glm5-flash-1m.toml"), plugins)
    layout = Layout.parse("dp=4,cp=2,ep=32,tp=8,etp=2")
    out = {}
    for seq_len, label in COLUMNS:
        result = plan(recipe, plugins, seq_len=seq_len, layout=layout, machine=Machine("cuda", 178 * GiB, 180 * GiB))
        out[(seq_len, label)] = next(e for e in result.candidates if e.label == label)
    return out


def terms(e: Estimate) -> dict[str, float]:
    """The README table's rows, in GiB, by the start of their label."""
    kept = sum(v for k, v in e.saved_by_kind.items() if k != "embedding+head")
    return {
        "runtime": e.runtime, "weights": e.weights, "gradients": e.gradients, "optimizer state on the device": e.optimizer,
        "block inputs kept": kept, "what one layer re-creates": e.recompute_peak,
        "embedding and output head": e.saved_by_kind["embedding+head"], "gradient stream": e.gradient_stream,
        "**predicted peak**": e.device_peak, "pinned host memory": e.host, "pageable host memory": e.host_optimizer,
    }


def readme_rows() -> dict[str, list[float]]:
    section = README.read_text().split("## The reported figures", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\**[\d.]+\**", cells[1]):
            rows[cells[0]] = [float(c.strip("*")) for c in cells[1:]]
    return rows


def test_the_readme_table_is_the_plan(estimates):
    rows = readme_rows()
    for name in terms(next(iter(estimates.values()))):
        row = next(values for label, values in rows.items() if label.startswith(name))
        for column, value in zip(COLUMNS, row, strict=True):
            assert terms(estimates[column])[name] / GiB == pytest.approx(value, abs=0.006), (name, column)


def test_the_pinned_peaks_and_their_shortfall(estimates):
    for column, (predicted, reported) in PEAKS.items():
        e = estimates[column]
        assert e.device_peak / GiB == pytest.approx(predicted, abs=0.006), column
        assert e.fits and e.device_peak < reported * GiB  # short of every reported peak: the README's unknown terms
    # per GPU between components: the sequence's share of a cp = 2 rank, split by sequence parallelism over tp = 8
    tokens = {seq_len: seq_len // 2 // 8 for seq_len, _ in COLUMNS}
    for (seq_len, label), e in estimates.items():
        assert e.gradient_stream == 3 * tokens[seq_len] * 4096 * 2
        inputs = 45 * tokens[seq_len] * 4096 * 2  # the bf16 block inputs, one per layer
        assert (e.host, sum(e.saved_by_kind.values()) - e.saved_by_kind["embedding+head"]) == (
            (inputs, 0) if "offload" in label else (0, inputs))
