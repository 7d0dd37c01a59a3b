"""Conformance suite for eval analyses (see ``megaseq.contracts.EvalAnalysis``).

Subclass :class:`EvalAnalysisConformance` in a pytest module and set ``name`` and ``config``; the tests build
the analysis through the installed plugins for a model and ``baselines`` scored on ``windows`` windows of
``seq_len`` targets, and feed it synthetic windows (random bases with repeats planted at several distances
and a run of N) and losses. Override :meth:`EvalAnalysisConformance.build` for one that is not a plugin.
Every check here has a
deliberately wrong analysis in the kit's own tests (``packages/testkit/tests/test_eval_analysis_conformance.py``)
that it catches.

Tolerance: numbers of two results are compared relative to their size, ``tolerance`` (default 1e-9) times
max(1, |value|).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from megaseq.contracts import EvalAnalysis, EvalInfo
from megaseq.data.tokenizer import N_ID

Feed = list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]]


class EvalAnalysisConformance:
    """Base class of an eval analysis's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    baselines: ClassVar[tuple[str, ...]] = ("base-a", "base-b")
    windows: ClassVar[int] = 5
    seq_len: ClassVar[int] = 701  # odd, and long enough for repeats more than 512 bases apart
    tolerance: ClassVar[float] = 1e-9

    def info(self) -> EvalInfo:
        return EvalInfo("<conformance>", self.seq_len, self.windows, tuple(self.baselines))

    def build(self) -> Any:
        from megaseq_testkit import installed_plugins

        provided = installed_plugins().get("eval_analysis", self.name)
        return provided.load()(provided.spec.config(**self.config), self.info())

    # -- inputs ---------------------------------------------------------------------------------------
    def feed(self, seed: int = 0) -> Feed:
        """``(scorer, window, ids, losses, weights)`` for every scorer and window, scorer by scorer: random
        bases with repeats planted 20, 100 and 600 bases back (so a copier has something to copy at short
        and long range), a run of N (weight 0) and soft-masked targets (weight 0.5); each scorer's losses are
        random, the model's smaller where the planted copy would be right."""
        rng = np.random.default_rng(seed)
        length = self.seq_len
        ids = rng.integers(0, 4, size=(self.windows, length + 1))
        for back, (start, size) in ((20, (30, 40)), (100, (150, 60)), (600, (620, 60))):
            if start + size <= length + 1 and start >= back:
                ids[:, start : start + size] = ids[:, start - back : start - back + size]
        ids[0, length // 3 : length // 3 + 7] = N_ID
        weights = np.ones((self.windows, length))
        weights[ids[:, 1:] == N_ID] = 0.0
        weights[:, 5:25] *= 0.5
        out: Feed = []
        for i, scorer in enumerate(self.info().scorers):
            losses = rng.uniform(0.2, 2.0, size=(self.windows, length)) * (1 + 0.1 * i)
            if i == 0:
                losses[:, 180:209] *= 0.1
            for window in range(self.windows):
                out.append((scorer, window, ids[window].astype(np.int64), losses[window], weights[window].copy()))
        return out

    def run(self, feed: Feed, out_dir: Path | None = None) -> tuple[dict[str, Any], str]:
        analysis = self.build()
        for scorer, window, ids, losses, weights in feed:
            analysis.add(scorer, window, ids.copy(), losses.copy(), weights.copy())
        result = analysis.finish(out_dir)
        assert isinstance(result, tuple) and len(result) == 2, "finish must return (result dict, text table)"
        return result

    def assert_same(self, a: Any, b: Any, what: str, path: str = "result") -> None:
        """Two results are equal: the same structure, strings and None alike, numbers within tolerance."""
        if isinstance(a, dict) and isinstance(b, dict):
            assert a.keys() == b.keys(), f"{what}: {path} has keys {sorted(a)} vs {sorted(b)}"
            for key in a:
                self.assert_same(a[key], b[key], what, f"{path}[{key!r}]")
        elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
            assert len(a) == len(b), f"{what}: {path} has {len(a)} vs {len(b)} items"
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                self.assert_same(x, y, what, f"{path}[{i}]")
        elif isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
            assert abs(a - b) <= self.tolerance * max(1.0, abs(a), abs(b)), f"{what}: {path} is {a!r} vs {b!r}"
        else:
            assert a == b, f"{what}: {path} is {a!r} vs {b!r}"

    # -- the contract ---------------------------------------------------------------------------------
    def test_protocol(self) -> None:
        analysis = self.build()
        assert isinstance(analysis, EvalAnalysis), f"{type(analysis).__name__} does not implement megaseq.contracts.EvalAnalysis"

    def test_result_is_json_and_table_is_text(self) -> None:
        """The result goes into heldout.json: plain JSON types only, no NaN or infinity; the table is text."""
        result, table = self.run(self.feed())
        assert isinstance(result, dict) and result, "the result must be a non-empty dict"
        try:
            text = json.dumps(result, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise AssertionError(f"the result is not plain JSON: {exc}") from None
        self.assert_same(json.loads(text), result, "the result after a JSON round trip")
        assert isinstance(table, str), f"the table must be a str, got {type(table).__name__}"

    def test_writes_only_into_out_dir(self, tmp_path: Path, monkeypatch: Any) -> None:
        """finish(out_dir) writes into out_dir only; finish(None) writes nothing."""
        monkeypatch.chdir(tmp_path)
        self.run(self.feed())
        assert not list(tmp_path.rglob("*")), f"finish(None) wrote {sorted(p.name for p in tmp_path.rglob('*'))}"
        out = tmp_path / "out"
        out.mkdir()
        self.run(self.feed(), out)
        outside = [p for p in tmp_path.rglob("*") if p != out and not p.is_relative_to(out)]
        assert not outside, f"finish(out_dir) wrote outside out_dir: {sorted(str(p) for p in outside)}"

    def test_feed_order_does_not_matter(self) -> None:
        """Windows and scorers arrive in any order (the evaluation feeds scorer by scorer, in batches): the
        feed reversed (the last baseline first, windows backwards) and shuffled give the same result."""
        feed = self.feed()
        first, _ = self.run(feed)
        self.assert_same(self.run(feed[::-1])[0], first, "fed in reverse order")
        shuffled = [feed[i] for i in np.random.default_rng(1).permutation(len(feed))]
        self.assert_same(self.run(shuffled)[0], first, "fed in a shuffled order")

    def test_unscored_targets_do_not_count(self) -> None:
        """A target of weight 0 may carry any loss (inf, NaN): the result is that with loss 0 there."""
        feed = self.feed()
        zeroed = [(s, w, ids, np.where(weights > 0, losses, 0.0), weights) for s, w, ids, losses, weights in feed]
        wild = [(s, w, ids, np.where(weights > 0, losses, np.nan if w % 2 else np.inf), weights) for s, w, ids, losses, weights in feed]
        assert any((weights == 0).any() for *_, weights in feed)
        self.assert_same(self.run(wild)[0], self.run(zeroed)[0], "losses of weight-0 targets changed the result")

    def test_deterministic(self) -> None:
        feed = self.feed()
        first, table = self.run(feed)
        second, again = self.run(feed)
        self.assert_same(second, first, "two builds, the same feed")
        assert again == table, "two builds, the same feed: the tables differ"

