"""The context-extension report: ``report.json``, ``bits_by_bucket.png``, ``retrieval_by_distance.png`` and
``report.md`` (the tables docs/results.md shows).

Besides the loss by context position, the report holds the retrieval table (``megaseq_genome.retrieval``):
bits/base by the distance back to the last earlier occurrence of each target's preceding k-mer, per model
and Markov baseline, the perfect copier's bits over the highest-order Markov baseline, and the share of its
gain each model captures, with intervals over the same window resamples as the rest.

The experiment's targets (:func:`check_targets`), each checked and printed met or missed with its 95% interval
(``captured``: the share of the perfect copier's gain over the highest-order Markov baseline, k = 20):

- (a) the pretrain captures at least 50% on targets whose 20-mer last occurred < 512 bases back, at least 30% at
  512-4k;
- (b) the long continuation captures at least 30% at 4k-16k and at 16k-64k, where the short continuation's
  interval includes 0 (what the long one gains there is context the short one did not learn to use);
- (c) on targets with no earlier 20-mer the curriculum costs at most 0.5% against the control (pretrain over
  control, paired), and the long continuation's overall loss is below the Markov baseline's;
- (d) by context position, the long continuation beats the short one past ``short_len``, its paired interval
  below zero.

A threshold is met by its estimate; the report also says whether the interval clears it (``resolved``). A goal
about an interval (the short continuation's includes 0, the gain's lies above zero) is met by the interval. A
check whose bucket holds no target is "not measured"; a check of a model the plan does not train is left out.

Columns of every per-window array: one per position bucket, then ``all``, then the positions inside the
pretraining length (``<short_len``) and past it (``>=short_len``: targets with more than ``short_len`` tokens
of preceding context). Intervals are percentile bootstraps over held-out windows (``megaseq_genome.bootstrap``);
relative changes are paired with the short-context continuation on the same resamples.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from megaseq.eval.positions import LN2
from megaseq_genome import retrieval
from megaseq_genome.bootstrap import flat_within_intervals, mean_interval, relative_interval, resample_weights
from megaseq_genome.heldout_set import HeldoutSet
from megaseq_genome.retrieval import RetrievalLoss

REFERENCE = "short"
RETRIEVAL_K = 20  # the k-mer length of the targets and the plot (report.md and report.json have every k)
# (target, model, distance bucket, least share of the copier's gain captured)
CAPTURED_GOALS = (("a", "pretrain", "<512", 0.5), ("a", "pretrain", "512-4k", 0.3),
                  ("b", "long", "4k-16k", 0.3), ("b", "long", "16k-64k", 0.3))
CURRICULUM_COST = 0.005  # the pretrain at most 0.5% above the control on targets without an earlier k-mer


def _label(position: int) -> str:
    for unit, size in (("M", 1 << 20), ("k", 1 << 10)):
        if position >= size and position % size == 0:
            return f"{position // size}{unit}"
    return str(position)


def columns(edges: list[int], short_len: int) -> list[str]:
    return [f"{_label(a)}-{_label(b)}" for a, b in itertools.pairwise(edges)] + [
        "all", f"<{_label(short_len)}", f">={_label(short_len)}"
    ]


def per_window_bits(sums: np.ndarray, edges: list[int], short_len: int) -> np.ndarray:
    """``[windows, columns]`` mean bits/base (see the module docstring) from per-bucket loss sums in nats."""
    widths = np.diff(edges).astype(np.float64)
    starts = np.asarray(edges[:-1])
    if short_len not in edges:
        raise ValueError(f"short_len {short_len} is not a bucket edge of {edges}")
    within, beyond = starts < short_len, starts >= short_len

    def pooled(mask: np.ndarray) -> np.ndarray:
        return sums[:, mask].sum(1, keepdims=True) / widths[mask].sum()

    overall = sums.sum(1, keepdims=True) / widths.sum()
    return np.concatenate([sums / widths, overall, pooled(within), pooled(beyond)], axis=1) / LN2


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _fmt(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return f"{100 * value:+.2f}%"


def build_report(
    out: Path, plan: Any, stages: list[Any], heldout: HeldoutSet, params: dict[str, int], paths: dict[str, Path]
) -> dict:
    """The report's data; ``paths``: each model's and baseline's evaluation (``.npz`` beside its ``.json``)."""
    names = [s.name for s in stages] + [f"markov-{k}" for k in plan.markov_orders]
    arrays, edges, retrieval_sums = {}, None, {}
    for name in names:
        with np.load(paths[name]) as saved:
            edges = saved["edges"].tolist()
            arrays[name] = per_window_bits(saved["sums"], edges, plan.short_len)
            retrieval_sums[name] = RetrievalLoss.from_arrays(dict(saved))
    assert edges is not None
    cols = columns(edges, plan.short_len)
    weights = resample_weights(len(heldout.starts), plan.bootstrap_samples, seed=0)
    by_stage = {s.name: s for s in stages}
    models: dict[str, Any] = {}
    for name in names:
        entry: dict[str, Any] = {"bits_per_base": mean_interval(arrays[name], weights, plan.confidence)}
        if REFERENCE in arrays:
            entry["relative_to_short"] = relative_interval(arrays[name], arrays[REFERENCE], weights, plan.confidence)
        entry["eval"] = _read_json(paths[name].with_suffix(".json"))
        if name in by_stage:
            stage = by_stage[name]
            run = _read_json(out / name / "stage.json")
            before = by_stage[stage.init_from].tokens if stage.init_from else 0
            entry.update(
                kind="model",
                parameters=params[name],
                seq_len=stage.recipe.data.seq_len,
                steps=stage.steps,
                stage_tokens=run.get("tokens", stage.tokens),
                tokens_seen=before + run.get("tokens", stage.tokens),
                starts_from=stage.init_from,
                train=run,
                eval_context=stage.eval_context,
            )
        else:
            entry["kind"] = "markov"
        models[name] = entry

    n_buckets = len(edges) - 1
    markov_flat = {
        name: flat_within_intervals(m["bits_per_base"]["low"][:n_buckets], m["bits_per_base"]["high"][:n_buckets])
        for name, m in models.items() if m["kind"] == "markov"
    }
    reference = f"markov-{max(plan.markov_orders)}"
    table = retrieval.retrieval_table(retrieval_sums, reference, weights, plan.confidence)
    long_vs_reference = (relative_interval(arrays["long"], arrays[reference], weights, plan.confidence)
                         if "long" in arrays else None)
    vs_control = (retrieval.relative_change(retrieval_sums, "pretrain", "control", weights, plan.confidence)
                  if {"pretrain", "control"} <= set(models) else None)
    targets = check_targets(table, long_vs_reference, vs_control, models, cols, n_buckets + 2)
    if REFERENCE in models and "long" in models:
        targets["verdict"] = verdict(models["long"]["relative_to_short"], cols, n_buckets + 1, n_buckets + 2, plan.short_len)
    return {
        "plan": plan.model_dump(mode="json"),
        "heldout": heldout.describe(),
        "columns": cols,
        "bucket_edges": edges,
        "models": models,
        "markov_flat_within_interval": markov_flat,
        "targets": targets,
        "retrieval": table,
    }


def check(target: str, claim: str, summary: tuple[float | None, float | None, float | None], goal: str,
          threshold: float, form: str) -> dict[str, Any]:
    """One check of a target: ``summary`` (estimate, low, high) against ``threshold`` by ``goal``: ``at_least``,
    ``at_most``, ``below`` (met by the estimate; ``resolved`` when the interval clears the threshold too),
    ``contains`` or ``interval_below`` (met by the interval). ``met`` is None where nothing was measured;
    ``form`` says how report.md prints the values: ``share`` (a percentage) or ``relative`` (a signed change)."""
    mean, low, high = summary
    if mean is None or low is None or high is None:
        met = resolved = None
    elif goal == "at_least":
        met, resolved = mean >= threshold, low >= threshold
    elif goal == "at_most":
        met, resolved = mean <= threshold, high <= threshold
    elif goal == "below":
        met, resolved = mean < threshold, high < threshold
    elif goal == "contains":
        met = resolved = low <= threshold <= high
    elif goal == "interval_below":
        met = resolved = high < threshold
    else:
        raise ValueError(f"unknown goal {goal!r}")
    return {"target": target, "claim": claim, "mean": mean, "low": low, "high": high, "goal": goal,
            "threshold": threshold, "format": form, "met": met, "resolved": resolved}


def _at(summary: dict[str, list], *index: int) -> tuple[float | None, float | None, float | None]:
    def pick(values: Any) -> float | None:
        for i in index:
            values = values[i]
        return values

    return pick(summary["mean"]), pick(summary["low"]), pick(summary["high"])


def check_targets(
    table: dict[str, Any], long_vs_reference: dict[str, list] | None, vs_control: dict[str, list] | None,
    models: dict[str, Any], cols: list[str], beyond: int,
) -> dict[str, Any]:
    """The targets (module docstring) from the retrieval table (``table``), the long continuation's bits relative
    to the table's reference baseline (``long_vs_reference``, paired, by column), the pretrain's retrieval bits
    relative to the control's (``vs_control``, paired, per k and bucket) and the models (``relative_to_short``,
    by column); ``beyond`` is the column of the targets past short_len."""
    k, buckets, reference = table["ks"].index(RETRIEVAL_K), table["buckets"], table["reference"]
    captured = {name: entry["captured"] for name, entry in table["models"].items()}
    checks = []
    for target, model, bucket, least in CAPTURED_GOALS:
        if model in captured:
            checks.append(check(target, f"{model} captures, {RETRIEVAL_K}-mer last seen {bucket} back", _at(
                captured[model], k, buckets.index(bucket)), "at_least", least, "share"))
        if target == "b" and REFERENCE in captured:
            checks.append(check(target, f"{REFERENCE} captures, {RETRIEVAL_K}-mer last seen {bucket} back", _at(
                captured[REFERENCE], k, buckets.index(bucket)), "contains", 0.0, "share"))
    if vs_control is not None:
        checks.append(check("c", f"pretrain vs control, no earlier {RETRIEVAL_K}-mer", _at(
            vs_control, k, retrieval.NONE), "at_most", CURRICULUM_COST, "relative"))
    if long_vs_reference is not None:
        checks.append(check("c", f"long vs {reference}, all targets", _at(long_vs_reference, cols.index("all")),
                            "below", 0.0, "relative"))
    if "long" in models and REFERENCE in models:
        checks.append(check("d", f"long vs {REFERENCE}, targets past {cols[beyond][2:]} of context ({cols[beyond]})",
                            _at(models["long"]["relative_to_short"], beyond), "interval_below", 0.0, "relative"))
    summary = {}
    for target in sorted({c["target"] for c in checks}):
        mets = [c["met"] for c in checks if c["target"] == target]
        summary[target] = False if False in mets else None if None in mets else True
    return {"checks": checks, "met": summary, "reference": reference, "k": RETRIEVAL_K}


def _value(value: float | None, form: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if form == "share" else _pct(value)


GOAL_TEXT = {"at_least": "goal >= {}", "at_most": "goal <= {}", "below": "goal < {}", "contains": "goal: interval includes {}",
             "interval_below": "goal: interval below {}"}


def target_lines(targets: dict[str, Any]) -> list[str]:
    """report.md's lines of the targets: one per target, its checks with their estimates and intervals."""
    lines = [f"Targets (k = {targets['k']}; captured: the share of the perfect copier's gain over {targets['reference']}; "
             "95% intervals over windows; relative: paired):", ""]
    status = {True: "met", False: "missed", None: "not measured"}
    for target, met in targets["met"].items():
        parts = []
        for c in (c for c in targets["checks"] if c["target"] == target):
            goal = GOAL_TEXT[c["goal"]].format(_value(c["threshold"], c["format"]))
            clears = "" if c["resolved"] is None or c["goal"] in ("contains", "interval_below") else (
                ", the interval clears it" if c["resolved"] else ", the interval includes it"
                if c["low"] <= c["threshold"] <= c["high"] else ", the whole interval misses it")
            parts.append(f"{c['claim']}: {_value(c['mean'], c['format'])} [{_value(c['low'], c['format'])}, "
                         f"{_value(c['high'], c['format'])}] ({goal}: {status[c['met']]}{clears})")
        lines.append(f"- ({target}) **{status[met]}**: " + "; ".join(parts) + ".")
    return lines


def verdict(rel: dict[str, list[float]], cols: list[str], within: int, beyond: int, short_len: int) -> str:
    """One sentence: does the long continuation's gain over the short one concentrate past short_len?"""
    inside, past = rel["mean"][within], rel["mean"][beyond]
    significant = rel["high"][beyond] < 0
    concentrated = significant and past < inside and rel["high"][beyond] < rel["low"][within]
    numbers = (
        f"long vs short continuation: {_pct(past)} [{_pct(rel['low'][beyond])}, {_pct(rel['high'][beyond])}] on "
        f"targets past {_label(short_len)} of context ({cols[beyond]}), {_pct(inside)} "
        f"[{_pct(rel['low'][within])}, {_pct(rel['high'][within])}] inside it ({cols[within]})"
    )
    if concentrated:
        return f"Yes: the long-context gain concentrates past the pretraining length. {numbers}."
    if significant:
        return f"Partly: the long continuation is better past the pretraining length, but not more than inside it. {numbers}."
    return f"No: no long-context gain past the pretraining length is resolved. {numbers}."


def markdown(report: dict) -> str:
    cols, models = report["columns"], report["models"]
    names = list(models)
    lines = ["Bits/base on the held-out set by context position (95% bootstrap interval half-width in brackets):", ""]
    lines.append("| positions | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    for c, col in enumerate(cols):
        cells = []
        for name in names:
            b = models[name]["bits_per_base"]
            cells.append(f"{_fmt(b['mean'][c])} (±{(b['high'][c] - b['low'][c]) / 2:.4f})")
        lines.append(f"| {col} | " + " | ".join(cells) + " |")
    compared = [n for n in names if n != REFERENCE and "relative_to_short" in models[n]]
    if compared:
        lines += ["", f"Relative change from the short-context continuation ({REFERENCE}), same windows, paired 95% interval:", ""]
        lines.append("| positions | " + " | ".join(compared) + " |")
        lines.append("|---|" + "---:|" * len(compared))
        for c, col in enumerate(cols):
            cells = [
                f"{_pct(r['mean'][c])} [{_pct(r['low'][c])}, {_pct(r['high'][c])}]"
                for r in (models[n]["relative_to_short"] for n in compared)
            ]
            lines.append(f"| {col} | " + " | ".join(cells) + " |")
    lines += ["", "| run | parameters | context | steps | tokens (stage) | tokens seen | train wall | train peak RSS | eval wall | eval peak RSS |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        m = models[name]
        ev = m.get("eval", {})
        evals = f"{ev.get('wall_s', float('nan')):.0f} s | {ev.get('peak_rss_gib', float('nan')):.2f} GiB"
        if m["kind"] == "model":
            tr = m["train"]
            lines.append(
                f"| {name} | {m['parameters']:,} | {m['seq_len']:,} | {m['steps']} | {m['stage_tokens']:,} | {m['tokens_seen']:,} | "
                f"{tr.get('wall_s', float('nan')):.0f} s | {tr.get('peak_rss_gib', float('nan')):.2f} GiB | {evals} |"
            )
        else:
            lines.append(f"| {name} | - | - | - | - | - | fit {ev.get('fit_s', float('nan')):.0f} s | - | {evals} |")
    t = report["targets"]
    lines += ["", *target_lines(t), ""]
    for name, flat in report["markov_flat_within_interval"].items():
        verb = "is flat" if flat else "is NOT flat"
        lines.append(f"- {name} {verb} within its intervals across buckets (flat: one value lies in every bucket's interval).")
    if "verdict" in t:
        lines += ["", t["verdict"]]
    return "\n".join(lines) + "\n\n" + "\n".join(retrieval.markdown(report["retrieval"], k) for k in report["retrieval"]["ks"])


def plot(report: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    edges = report["bucket_edges"]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    n = len(mids)
    short_len = report["plan"]["short_len"]
    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for name, m in report["models"].items():
        b = m["bits_per_base"]
        mean = np.asarray(b["mean"][:n])
        err = [mean - np.asarray(b["low"][:n]), np.asarray(b["high"][:n]) - mean]
        style = "--" if m["kind"] == "markov" else "-"
        left.errorbar(mids, mean, yerr=err, marker="o", ms=3, capsize=2, linestyle=style, label=name)
        if name != REFERENCE and "relative_to_short" in m and m["kind"] == "model":
            r = m["relative_to_short"]
            rm = 100 * np.asarray(r["mean"][:n])
            rerr = [rm - 100 * np.asarray(r["low"][:n]), 100 * np.asarray(r["high"][:n]) - rm]
            right.errorbar(mids, rm, yerr=rerr, marker="o", ms=3, capsize=2, label=f"{name} vs {REFERENCE}")
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.axvline(short_len, color="grey", linestyle=":", linewidth=1)
        axes.set_xlabel("position in window (tokens of preceding context)")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    right.axhline(0, color="black", linewidth=0.8)
    left.set_ylabel("bits per base")
    right.set_ylabel("relative change (%)")
    held = report["heldout"]
    left.set_title(f"held-out {held['dataset']}: {held['windows']} windows of {held['window_targets']:,}", fontsize=9)
    right.set_title("change from the short-context continuation (paired)", fontsize=9)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def write_report(
    out: Path, plan: Any, stages: list[Any], heldout: HeldoutSet, params: dict[str, int], paths: dict[str, Path]
) -> dict:
    report = build_report(out, plan, stages, heldout, params, paths)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "bits_by_bucket.png")
    retrieval.plot(report["retrieval"], out / "retrieval_by_distance.png", RETRIEVAL_K)
    return report
