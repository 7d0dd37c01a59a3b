"""The components of the megaseq project's own packages, and which package provides each.

Core never imports a plugin; it only knows their names, so that a recipe naming a component whose package is
not installed gets told what to install (``megaseq-attn-dsa`` for ``dsa``). A repository test checks that
every package in this repository registers exactly the components listed here.
"""

from __future__ import annotations

# (kind, component name) -> distribution that provides it
PROVIDERS: dict[tuple[str, str], str] = {
    ("attention", "sdpa"): "megaseq-core",
    ("ffn", "swiglu"): "megaseq-core",
    ("attention", "kda"): "megaseq-attn-kda",
    ("attention", "dsa"): "megaseq-attn-dsa",
    ("moe", "chunked"): "megaseq-moe-chunked",
    ("memory_policy", "recompute"): "megaseq-offload",
    ("memory_policy", "offload"): "megaseq-offload",
    ("attention", "sliding-window"): "megaseq-sliding-window",
    ("inference_engine", "cached"): "megaseq-core",
    ("inference_engine", "vllm"): "megaseq-rl",
    ("rl_algorithm", "grpo"): "megaseq-rl",
    ("rl_algorithm", "rloo"): "megaseq-rl",
    ("rl_algorithm", "dapo"): "megaseq-rl",
    ("command", "rl"): "megaseq-rl",
    ("command", "logprob-gap"): "megaseq-rl",
    ("data_source", "excerpt-chr20"): "megaseq-core",
    ("data_source", "excerpt-chrX"): "megaseq-core",
    ("data_source", "grch37-chr20"): "megaseq-genome",
    ("data_source", "grch37-chrX"): "megaseq-genome",
    ("baseline", "markov"): "megaseq-genome",
    ("command", "context-extension"): "megaseq-genome",
    ("eval_analysis", "retrieval"): "megaseq-genome",
}


def provider(kind: str, name: str) -> str | None:
    """The megaseq distribution that provides component ``name`` of ``kind``, if it is one of ours."""
    return PROVIDERS.get((kind, name))


__all__ = ["PROVIDERS", "provider"]
