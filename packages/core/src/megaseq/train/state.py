"""Small records the trainer hands to plugins."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    """Where training stands when a lifecycle hook runs. ``step`` counts optimizer steps from 1."""

    step: int
    total_steps: int
    tokens: int
    lr: float
