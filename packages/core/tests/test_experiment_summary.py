"""What `megaseq train` prints after a genome run: the comparison with the context-extension experiment."""

from __future__ import annotations

import json

from megaseq.experiment.summary import COMMAND, RECORDED, comparison

HELDOUT = {"results": {"model": {"bits_per_base": 1.90}, "markov-8": {"bits_per_base": 1.84}}}


def test_without_a_report_it_states_the_target_on_the_experiments_set(tmp_path):
    text = comparison(HELDOUT, 614_400, 8, report_path=tmp_path / "none.json")
    assert "this run:    1.9000 bits/base, +3.3% vs order-8 Markov on the same windows, after 614,400 training tokens" in text
    assert "experiment:  not run on this machine yet" in text
    target = 0.97 * RECORDED["markov-11"]
    assert f"at most {target:.4f} bits/base" in text and f"{100 * (target / RECORDED['markov-8'] - 1):+.1f}% vs order-8" in text
    assert COMMAND in text and "--scale cpu-quick" in text


def test_a_local_report_gives_the_experiments_numbers(tmp_path):
    report = {
        "columns": ["0-128", "all"],
        "models": {
            "long": {"bits_per_base": {"mean": [1.9, 1.76]}, "tokens_seen": 7_340_032},
            "markov-8": {"bits_per_base": {"mean": [1.85, 1.80]}},
            "markov-11": {"bits_per_base": {"mean": [1.80, 1.79]}},
        },
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    text = comparison(HELDOUT, 614_400, 8, report_path=path)
    assert f"experiment:  1.7600 bits/base, -2.2% vs order-8 Markov (the 64k-context hybrid after 7,340,032 tokens; {path})" in text
    assert f"at most {0.97 * 1.79:.4f} bits/base" in text
