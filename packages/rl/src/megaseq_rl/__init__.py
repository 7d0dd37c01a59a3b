"""megaseq-rl: policy-gradient RL on megaseq models, inference engines, and the trainer/engine logprob gap."""

from megaseq_rl.__about__ import __version__

__all__ = ["__version__"]
