"""Sigmoid router: the bias steers the choice, not the weights; normalised scaled weights; bias update."""

import torch

from megaseq_moe.router import Router


def make_router(scaling: float = 2.5) -> Router:
    torch.manual_seed(0)
    return Router(d_model=16, n_experts=6, top_k=2, scaling=scaling, init_std=0.5)


def test_weights_are_normalised_chosen_affinities_times_scaling() -> None:
    router = make_router()
    x = torch.randn(9, 16)
    s = router.affinities(x)
    assert torch.allclose(s, torch.sigmoid(x.double() @ router.weight.double().t()).float(), atol=1e-6)
    indices = router.select(s)
    weights = router.combine_weights(s, indices)
    assert torch.allclose(weights.sum(-1), torch.full((9,), 2.5))
    chosen = s.gather(-1, indices)
    assert torch.allclose(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    assert torch.equal(indices, s.topk(2, dim=-1).indices)


def test_bias_steers_choice_but_not_weights() -> None:
    router = make_router()
    x = torch.randn(9, 16)
    s = router.affinities(x)
    router.expert_bias[5] = 10.0  # expert 5 now wins every token's first slot
    indices = router.select(s)
    assert (indices[:, 0] == 5).all()
    chosen = s.gather(-1, indices)
    assert torch.allclose(router.combine_weights(s, indices), 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_bias_update_moves_towards_balance_and_rate_zero_freezes() -> None:
    router = make_router()
    load = torch.tensor([10, 0, 5, 5, 3, 7])  # mean 5
    router.update_bias(load, rate=0.1)
    expected = torch.tensor([-0.1, 0.1, 0.0, 0.0, 0.1, -0.1])
    assert torch.allclose(router.expert_bias, expected)
    router.update_bias(load, rate=0.0)
    assert torch.allclose(router.expert_bias, expected)
    assert "router.expert_bias" in torch.nn.ModuleDict({"router": router}).state_dict()
