"""Position-bucketed loss: bucket rule, hand-computed PositionLoss numbers, the table and the plot."""

import math
from pathlib import Path

import pytest
import torch

from megaseq.eval import PositionLoss, bucket_edges, format_table, plot_positions


@pytest.mark.parametrize(
    ("seq_len", "first", "edges"),
    [
        (4096, 1024, [0, 1024, 2048, 4096]),
        (3000, 1024, [0, 1024, 2048, 3000]),  # last bucket ends at seq_len
        (1025, 1024, [0, 1024, 1025]),
        (1024, 1024, [0, 128, 256, 512, 1024]),  # short window: first = 1024 // 8
        (100, 1024, [0, 8, 16, 32, 64, 100]),  # 100 // 8 = 12 -> power of two 8
        (8, 1024, [0, 1, 2, 4, 8]),
        (3, 1024, [0, 1, 2, 3]),
        (1, 1024, [0, 1]),
        (1 << 20, 1024, [0] + [1024 << i for i in range(11)]),
    ],
)
def test_bucket_edges(seq_len: int, first: int, edges: list[int]) -> None:
    assert bucket_edges(seq_len, first) == edges


def test_bucket_edges_rejects_nonpositive() -> None:
    with pytest.raises(ValueError, match="seq_len and first must be >= 1"):
        bucket_edges(0)


def hand_example() -> PositionLoss:
    positions = PositionLoss(4, first_bucket=2)  # buckets [0, 2) and [2, 4)
    token_loss = torch.tensor([[1.0, 2.0, math.inf, 4.0], [5.0, 6.0, 7.0, math.nan]])
    weights = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.5, 1.0, 0.0]])
    positions.add(token_loss, weights)
    return positions


def test_position_loss_hand_computed() -> None:
    summary = hand_example().summary()
    # [0, 2): (1 + 5 + 2 + 0.5 * 6) / (1 + 1 + 1 + 0.5) = 11 / 3.5; [2, 4): (7 + 4) / 2; all: 22 / 5.5.
    # Zero-weight targets (here inf and nan) do not count.
    assert summary["tokens"] == 6
    assert summary["nats_per_base"] == pytest.approx(4.0, rel=1e-12)
    assert summary["bits_per_base"] == pytest.approx(4.0 / math.log(2), rel=1e-12)
    first, second = summary["buckets"]
    assert (first["start"], first["end"], first["tokens"]) == (0, 2, 4)
    assert first["nats_per_base"] == pytest.approx(11 / 3.5, rel=1e-12)
    assert (second["start"], second["end"], second["tokens"]) == (2, 4, 2)
    assert second["bits_per_base"] == pytest.approx(5.5 / math.log(2), rel=1e-12)


def test_position_loss_accumulates_batches() -> None:
    positions = hand_example()
    positions.add(torch.full((3, 4), 2.0), torch.ones(3, 4))
    summary = positions.summary()
    assert summary["tokens"] == 6 + 12
    assert summary["nats_per_base"] == pytest.approx((22 + 24) / (5.5 + 12), rel=1e-12)


def test_empty_bucket_reports_none() -> None:
    positions = PositionLoss(4, first_bucket=2)
    positions.add(torch.ones(1, 4), torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    summary = positions.summary()
    assert summary["buckets"][0] == {
        "start": 0,
        "end": 2,
        "nats_per_base": None,
        "bits_per_base": None,
        "tokens": 0,
    }
    assert summary["nats_per_base"] == pytest.approx(1.0)


def test_position_loss_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"must both be \[batch, 4\]"):
        PositionLoss(4).add(torch.ones(2, 5), torch.ones(2, 5))


def test_format_table() -> None:
    model = hand_example().summary()
    flat = PositionLoss(4, first_bucket=2)
    flat.add(torch.full((1, 4), math.log(4)), torch.ones(1, 4))
    table = format_table({"model": model, "markov-8": flat.summary()})
    assert table == (
        "positions   model  markov-8\n"
        "---------  ------  --------\n"
        "      0-2  4.5342    2.0000\n"
        "      2-4  7.9348    2.0000\n"
        "      all  5.7708    2.0000\n"
    )


def test_format_table_labels_and_mismatch() -> None:
    wide = PositionLoss(4096).summary()
    assert format_table({"m": wide}).splitlines()[2:5] == ["     0-1k  -", "    1k-2k  -", "    2k-4k  -"]
    with pytest.raises(ValueError, match="different position buckets"):
        format_table({"a": wide, "b": PositionLoss(2048).summary()})


def test_plot_positions_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "positions.png"
    plot_positions({"model": hand_example().summary()}, path, "held-out chrX")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
