"""The ``chunked`` strategy passes core's MoE conformance suite, built through the installed entry point.

Two configs: one whose widths suit ``grouped_mm`` (fp32 rows of 16-byte multiples), one with awkward widths
(the per-expert loop), a SwiGLU clamp that is active at the suite's input scale, two shared experts and the
balance loss (whose counts the tensor-parallel check needs summed over the ranks).
"""

import torch

from megaseq_testkit.moe import MoEConformance


class ChunkedSuite(MoEConformance):
    name = "chunked"

    def given_weights(self, module, x, indices):
        """The chunked router's weights written out: sigmoid affinities of the given experts, normalised over
        them, times the routed scaling factor (the balancing bias chooses experts, it does not weigh them)."""
        affinities = torch.sigmoid(x.double() @ module.router.weight.double().t())
        chosen = affinities.gather(-1, indices)
        return chosen / chosen.sum(-1, keepdim=True) * module.router.scaling


class TestChunkedGroupedMM(ChunkedSuite):
    name = "chunked"
    config = {"n_experts": 8, "top_k": 2, "expert_hidden": 24, "chunk_tokens": 5, "init_std": 0.2}


class TestChunkedLoopClampShared(ChunkedSuite):
    name = "chunked"
    config = {
        "n_experts": 5,
        "top_k": 3,
        "expert_hidden": 10,
        "n_shared_experts": 2,
        "shared_hidden": 5,
        "swiglu_limit": 0.5,
        "routed_scaling_factor": 2.5,
        "chunk_tokens": 4,
        "init_std": 0.3,
        "aux_loss_coef": 0.1,
    }
