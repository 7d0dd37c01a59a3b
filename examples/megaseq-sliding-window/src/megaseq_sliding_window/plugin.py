"""Registration hooks of the megaseq-sliding-window plugin (kept light: no torch import here)."""

from __future__ import annotations

from megaseq.hookspecs import hookimpl
from megaseq.records import AttentionSpec
from megaseq_sliding_window.config import SlidingWindowConfig


@hookimpl
def megaseq_attention() -> list[AttentionSpec]:
    return [
        AttentionSpec(
            name="sliding-window",
            target="megaseq_sliding_window.layer:build",
            config=SlidingWindowConfig,
            summary="causal softmax attention over the last `window` keys, blockwise (memory O(T * window))",
            memory="megaseq_sliding_window.layer:memory_estimate",
            capabilities=frozenset({"context_parallel"}),
        )
    ]
