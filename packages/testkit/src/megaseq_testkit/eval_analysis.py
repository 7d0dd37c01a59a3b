"""Conformance suite for eval analyses (see ``megaseq.contracts.EvalAnalysis``).

Subclass :class:`EvalAnalysisConformance` in a pytest module and set ``name`` and ``config``; the tests build
the analysis through the installed plugins for a model and ``baselines`` scored on ``windows`` windows of
``seq_len`` targets of ``alphabet``, and feed it synthetic windows (random letters with repeats planted at
several distances and a run of N) and losses. ``factory`` names a builder ``build(config_dict, info)`` to test
instead of an installed analysis; or override :meth:`EvalAnalysisConformance.build`. Every check here has a
deliberately wrong analysis in the kit's own tests (``packages/testkit/tests/test_eval_analysis_conformance.py``)
that it catches.

The checks: the protocol; a result that is plain JSON without NaN; files written into ``out_dir`` only; the same
result whatever the order of scorers and windows; targets of weight 0 not counting; targets counting by their
weight, not their window's (per target, not per window); nothing related across an unknown token (a document
boundary); two builds agreeing; the record declaring the alphabet it is tested on.

Tolerance: numbers of two results are compared relative to their size, ``tolerance`` (default 1e-9) times
max(1, |value|).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from megaseq.alphabets import Alphabet, alphabet_named
from megaseq.contracts import EvalAnalysis, EvalInfo

Feed = list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]]


class EvalAnalysisConformance:
    """Base class of an eval analysis's conformance tests."""

    name: ClassVar[str]
    config: ClassVar[dict[str, Any]] = {}
    factory: ClassVar[str | None] = None
    alphabet: ClassVar[str | Alphabet] = "dna"
    baselines: ClassVar[tuple[str, ...]] = ("base-a", "base-b")
    windows: ClassVar[int] = 5
    seq_len: ClassVar[int] = 701  # odd, and long enough for repeats more than 512 bases apart
    tolerance: ClassVar[float] = 1e-9

    def letters(self) -> Alphabet:
        return alphabet_named(self.alphabet, f"{type(self).__name__}.alphabet")

    def info(self) -> EvalInfo:
        return EvalInfo("<conformance>", self.seq_len, self.windows, tuple(self.baselines), self.letters())

    def plugins(self) -> Any:
        from megaseq_testkit import installed_plugins

        return installed_plugins()

    def build(self) -> Any:
        if self.factory is not None:
            from megaseq_testkit import load_factory

            return load_factory(self.factory)(dict(self.config), self.info())
        provided = self.plugins().get("eval_analysis", self.name)
        return provided.load()(provided.spec.config(**self.config), self.info())

    # -- inputs ---------------------------------------------------------------------------------------
    def feed(self, seed: int = 0) -> Feed:
        """``(scorer, window, ids, losses, weights)`` for every scorer and window, scorer by scorer: random
        letters with repeats planted 20, 100 and 600 letters back (so a copier has something to copy at short
        and long range), a run of N (weight 0) and soft-masked targets (weight 0.5); each scorer's losses are
        random, the model's smaller where the planted copy would be right."""
        rng = np.random.default_rng(seed)
        length, unknown = self.seq_len, self.letters().unknown_id
        ids = rng.integers(0, len(self.letters().letters), size=(self.windows, length + 1))
        for back, (start, size) in ((20, (30, 40)), (100, (150, 60)), (600, (620, 60))):
            if start + size <= length + 1 and start >= back:
                ids[:, start : start + size] = ids[:, start - back : start - back + size]
        ids[0, length // 3 : length // 3 + 7] = unknown
        weights = np.ones((self.windows, length))
        weights[ids[:, 1:] == unknown] = 0.0
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

    def test_handles_the_alphabet(self) -> None:
        """The record declares the alphabet the suite feeds it (a recipe in another is refused)."""
        if self.factory is not None or type(self).build is not EvalAnalysisConformance.build:
            return  # built without a record: its author declares the alphabets when registering it
        alphabets = self.plugins().get("eval_analysis", self.name).spec.alphabets
        assert self.letters().name in alphabets, (
            f"{self.name}: fed {self.letters().name} but its record declares alphabets {sorted(alphabets)}"
        )

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

    def test_targets_count_by_weight(self) -> None:
        """A target counts by its weight, whichever window holds it: tripling the weights of one window's targets
        (they now count three times) moves every per-target sum, so the result changes. An analysis that
        averages each window first, then the windows, gives the same result: its windows count alike however
        many scored targets they hold, and scaling a window's weights changes none of its averages."""
        feed = self.feed()
        first, _ = self.run(feed)
        heavier = [(s, w, ids, losses, weights * 3 if w == 0 else weights) for s, w, ids, losses, weights in feed]
        try:
            self.assert_same(self.run(heavier)[0], first, "")
        except AssertionError:
            return
        raise AssertionError(
            "the result is the same with window 0's weights tripled: the analysis counts windows, not targets (sum "
            "over targets weighted by their weights; do not average per window first)"
        )

    def test_context_stops_at_n(self) -> None:
        """Records are joined by one unknown token (N) into the held-out stream, so a window may hold the end of
        one document, an N, and the start of the next: no target is related to what lies before an N. With an
        N in the middle of every window and the targets before it weighing 0, replacing every token before the
        N (a copy of which lies after it) leaves the result unchanged."""
        feed = self.feed()
        unknown, n = self.letters().unknown_id, len(self.letters().letters)
        cut = self.seq_len // 2  # ids[cut] is the N: targets ids[cut + 1:] are the next document
        rng = np.random.default_rng(7)
        size = min(80, cut - 10, self.seq_len - cut - 40)
        assert size >= 20, f"seq_len {self.seq_len} is too short for this check (at least 141)"
        joined, fresh = {}, {}
        for window in range(self.windows):
            ids = rng.integers(0, n, size=self.seq_len + 1)
            ids[cut] = unknown
            ids[cut + 30 : cut + 30 + size] = ids[5 : 5 + size]  # the next document repeats the previous one
            other = ids.copy()
            other[:cut] = rng.integers(0, n, size=cut)  # another previous document
            joined[window], fresh[window] = ids, other
        before = np.arange(self.seq_len) < cut

        def documents(windows: dict[int, np.ndarray]) -> Feed:
            return [(s, w, windows[w].copy(), losses, np.where(before, 0.0, weights)) for s, w, _, losses, weights in feed]

        self.assert_same(self.run(documents(fresh))[0], self.run(documents(joined))[0],
                         "the tokens before an N (another document) changed the result")

    def test_deterministic(self) -> None:
        feed = self.feed()
        first, table = self.run(feed)
        second, again = self.run(feed)
        self.assert_same(second, first, "two builds, the same feed")
        assert again == table, "two builds, the same feed: the tables differ"

