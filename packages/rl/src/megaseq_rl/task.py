"""The genome RL task: continue a prefix of real DNA; the reward is verifiable against the genome itself.

``continuation``: a prompt is ``prompt_len`` bases at a random position of a chromosome (windows holding an
N are never drawn), the answer is the ``max_new_tokens`` bases that follow it, and the reward of a
completion is the fraction of its generated bases equal to the answer, base by base (0 for an empty one).
Prompts for training come from the training chromosome, a fixed set of held-out prompts from the held-out one.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from megaseq.data.sources import tokenized
from megaseq.data.tokenizer import N_ID, TOKEN_ID_MASK
from megaseq.errors import UserError


class ContinuationTask:
    def __init__(self, dataset: str, prompt_len: int, completion_len: int) -> None:
        self.dataset = dataset
        self.tokens = tokenized(dataset)
        self.prompt_len, self.completion_len = prompt_len, completion_len
        span = prompt_len + completion_len
        if len(self.tokens) < span:
            raise UserError(f"task: {dataset!r} has {len(self.tokens)} bases, fewer than prompt_len + max_new_tokens = {span}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        """``n`` prompts ``[n, prompt_len]`` and their true continuations ``[n, completion_len]`` (int64)."""
        span = self.prompt_len + self.completion_len
        rows: list[np.ndarray] = []
        for _ in range(1000):
            starts = rng.integers(0, len(self.tokens) - span + 1, size=4 * n)
            windows = (np.asarray(self.tokens)[starts[:, None] + np.arange(span)] & TOKEN_ID_MASK).astype(np.int64)
            rows.extend(w for w in windows if not (w == N_ID).any())
            if len(rows) >= n:
                break
        else:
            raise UserError(f"task: no window of {span} bases without N found in {self.dataset!r}")
        ids = torch.from_numpy(np.stack(rows[:n]))
        return ids[:, : self.prompt_len], ids[:, self.prompt_len :]

    def reward(self, answers: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
        """Fraction of generated bases (``mask``) equal to the answer, per completion ``[B]`` (fp32)."""
        hits = ((tokens == answers) & mask).sum(-1).float()
        return hits / mask.sum(-1).clamp_min(1).float()


def build_task(name: str, dataset: str, prompt_len: int, completion_len: int) -> ContinuationTask:
    if name != "continuation":
        raise UserError(f"task.name: unknown task {name!r}; available: continuation")
    return ContinuationTask(dataset, prompt_len, completion_len)
