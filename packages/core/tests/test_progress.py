"""The progress display (``megaseq.train.progress``): off a terminal plain lines, each step at most once; on a
terminal one line rewritten in place; rates over a window of recent steps, up to the step the line names."""

from __future__ import annotations

import io
import re

from megaseq.train.progress import WINDOW, Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps(bar: Progress, clock: Clock, seconds_and_tokens) -> None:
    for seconds, tokens in seconds_and_tokens:
        clock.now += seconds
        bar.record(tokens=tokens)
        bar.show(f"{bar.tokens_per_s:.0f} tok/s")


def test_off_a_terminal_a_plain_line_every_interval_and_the_last_once():
    clock, out = Clock(), io.StringIO()
    bar = Progress("train", 5, every=2, stream=out, clock=clock)
    steps(bar, clock, [(1, 100), (1, 300), (1, 200), (1, 200), (1, 200)])
    bar.close()
    assert out.getvalue().splitlines() == [
        "train 2/5 steps, 0:02 elapsed, 0:03 left: 200 tok/s",  # step 2's 300 tokens are in its own line's rate
        "train 4/5 steps, 0:04 elapsed, 0:01 left: 200 tok/s",
        "train 5/5 steps, 0:05 elapsed, 0:00 left: 200 tok/s",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_run_cut_short_ends_with_its_last_step_and_a_resumed_one_counts_from_where_it_was():
    clock, out = Clock(), io.StringIO()
    bar = Progress("train", 10, initial=4, every=4, stream=out, clock=clock)
    steps(bar, clock, [(2, 10), (2, 10), (2, 10)])
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == ["train 7/10 steps, 0:06 elapsed, 0:06 left: 5 tok/s"]


def test_rates_are_over_the_recent_steps():
    """One slow step (an evaluation between steps) moves the time left by a twentieth, not twentyfold."""
    clock, out = Clock(), io.StringIO()
    bar = Progress("train", 1000, every=1000, stream=out, clock=clock)
    steps(bar, clock, [(1, 10)] * (WINDOW + 5) + [(21, 10)])
    assert WINDOW == 20
    assert bar.line() == "train 26/1000 steps, 0:46 elapsed, 32:28 left: 5 tok/s"  # 2 s a step over the window


def test_on_a_terminal_one_line_in_place_and_an_inner_loop_below_it():
    clock, out = Clock(), Terminal()
    train = Progress("train", 3, stream=out, clock=clock)
    steps(train, clock, [(1, 100)])
    evaluation = Progress("eval model", 2, unit="batches", leave=False, stream=out, clock=clock)
    evaluation.advance()
    evaluation.close()
    steps(train, clock, [(1, 100), (1, 100)])
    train.close()
    text = out.getvalue()
    assert "\x1b" not in text and text.endswith("\n")
    frames = [frame.rstrip() for frame in re.split(r"[\r\n]", text) if frame.strip()]
    assert frames == [
        "train 1/3 steps, 0:01 elapsed, 0:02 left: 100 tok/s",
        "eval model 1/2 batches, 0:00 elapsed, 0:00 left",
        "train 2/3 steps, 0:02 elapsed, 0:01 left: 100 tok/s",
        "train 3/3 steps, 0:03 elapsed, 0:00 left: 100 tok/s",
    ]
    assert text.count("\n") == 2  # the train line the evaluation started under, and the last one


def test_disabled_shows_nothing():
    out = Terminal()
    bar = Progress("train", 2, stream=out, enabled=False)
    bar.advance()
    bar.close()
    assert out.getvalue() == ""


def test_training_and_evaluation_off_a_terminal_print_plain_lines_once(tmp_path, monkeypatch, capsys):
    from megaseq.config import validate_recipe
    from megaseq.train.trainer import Trainer
    from megaseq_testkit import fresh_plugins

    monkeypatch.setenv("MEGASEQ_CACHE", str(tmp_path / "cache"))
    plugins = fresh_plugins()
    recipe = validate_recipe({
        "run": {"name": "t", "out_dir": str(tmp_path / "run"), "device": "cpu"},
        "data": {"train": "excerpt-chr20", "heldout": "excerpt-chrX", "seq_len": 64},
        "model": {"d_model": 16, "n_layers": 1}, "attention": {"sdpa": {"n_heads": 2}},
        "train": {"steps": 4, "batch_size": 2, "warmup_steps": 1, "log_every": 2, "loss_chunk": 50},
        "eval": {"windows": 6, "batch_size": 2},
    }, plugins)
    Trainer(recipe, plugins, tensorboard=False).run()
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    train = [line for line in lines if line.startswith("train ")]
    assert [line.split(",")[0] for line in train] == ["train 2/4 steps", "train 4/4 steps"]
    assert all(re.search(r"left: loss \d\.\d{4} bits/base, \d+ tok/s, peak RSS \d+\.\d\d GiB \(plan", t) for t in train), train
    model = [line.split(",")[0] for line in lines if line.startswith("eval model ")]
    assert model == ["eval model 1/3 batches", "eval model 2/3 batches", "eval model 3/3 batches"]
