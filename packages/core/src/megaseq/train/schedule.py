"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
