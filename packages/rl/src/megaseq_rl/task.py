"""Genome RL tasks with verifiable rewards. A prompt is ``prompt_len`` bases at a random position of a
chromosome (windows holding an N are never drawn); training prompts come from the training chromosome, a
fixed set of held-out prompts from the held-out one.

``continuation``: the answer is the ``max_new_tokens`` bases that follow the prompt in the genome; the reward
of a completion is the fraction of its generated bases equal to the answer, base by base.
``gc-content`` (a design reward): ``1 - |GC fraction - gc_target| / max(gc_target, 1 - gc_target)`` over
the generated bases, and 0 for a completion containing the motif ``avoid``. Empty completions score 0.

The prompts' corpus is read as the policy's trainer read its data (:func:`task_corpus`): a data source gets its
``[data_source.NAME]`` config from the policy's recipe and the installed plugins, and ``train``/``heldout`` the part.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from megaseq.config import Recipe
from megaseq.data.sources import Corpus, tokenized
from megaseq.data.tokenizer import N_ID, TOKEN_ID_MASK, VOCAB
from megaseq.errors import UserError
from megaseq.plugins import Plugins


def task_corpus(recipe: Recipe, which: str, spec: str | None, plugins: Plugins) -> Corpus:
    """The policy recipe's ``data.<which>`` ("train" / "heldout"), or ``spec`` read in its place, as the trainer
    reads it (``Recipe.corpus``): a data source with the recipe's ``[data_source.NAME]`` config for that name,
    the part ``which`` and ``plugins``."""
    if spec is not None:
        recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={which: spec})})
    return recipe.corpus(which, plugins)


class ContinuationTask:
    def __init__(self, corpus: Corpus, prompt_len: int, completion_len: int) -> None:
        self.dataset = str(corpus)
        self.tokens = tokenized(corpus)
        self.prompt_len, self.completion_len = prompt_len, completion_len
        span = prompt_len + completion_len
        if len(self.tokens) < span:
            raise UserError(f"task: {self.dataset!r} has {len(self.tokens)} bases, fewer than prompt_len + max_new_tokens = {span}")

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


class GCContentTask(ContinuationTask):
    def __init__(self, corpus: Corpus, prompt_len: int, completion_len: int, gc_target: float, avoid: str) -> None:
        super().__init__(corpus, prompt_len, completion_len)
        self.gc_target = gc_target
        self.motif = torch.tensor([VOCAB.index(base) for base in avoid.upper()], dtype=torch.int64)

    def contains_motif(self, tokens: Tensor, mask: Tensor) -> Tensor:
        width = len(self.motif)
        if width == 0 or tokens.shape[1] < width:
            return torch.zeros(tokens.shape[0], dtype=torch.bool)
        windows, valid = tokens.unfold(1, width, 1), mask.unfold(1, width, 1).all(-1)
        return ((windows == self.motif).all(-1) & valid).any(-1)

    def reward(self, answers: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
        gc = (((tokens == VOCAB.index("G")) | (tokens == VOCAB.index("C"))) & mask).sum(-1).float()
        fraction = gc / mask.sum(-1).clamp_min(1).float()
        score = 1 - (fraction - self.gc_target).abs() / max(self.gc_target, 1 - self.gc_target)
        return torch.where(self.contains_motif(tokens, mask) | (mask.sum(-1) == 0), 0.0, score)


def build_task(name: str, corpus: Corpus, prompt_len: int, completion_len: int, gc_target: float = 0.5, avoid: str = "") -> ContinuationTask:
    if name == "continuation":
        return ContinuationTask(corpus, prompt_len, completion_len)
    if name == "gc-content":
        return GCContentTask(corpus, prompt_len, completion_len, gc_target, avoid)
    raise UserError(f"task.name: unknown task {name!r}; available: continuation, gc-content")
