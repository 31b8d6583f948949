"""group_advantages, informative_groups, overlong_penalty against hand computations."""
import statistics

import pytest
import torch

from stare.algorithms import group_advantages, informative_groups, overlong_penalty


def test_group_advantages_matches_python_statistics():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (20, 8), generator=g).double()
    rewards[0] = torch.tensor([0, 0, 0, 1, 1, 0, 0, 0], dtype=torch.float64)
    adv = group_advantages(rewards, eps=1e-6)
    for i, row in enumerate(rewards.tolist()):
        if len(set(row)) == 1:
            assert adv[i].abs().max().item() == 0.0
            continue
        mu, sd = statistics.mean(row), statistics.stdev(row)  # sample std, as verl/OpenRLHF
        for j, r in enumerate(row):
            assert adv[i, j].item() == pytest.approx((r - mu) / (sd + 1e-6), rel=1e-12)


def test_dr_grpo_skips_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert group_advantages(rewards, std_norm=False).tolist() == [[0.75, -0.25, -0.25, -0.25]]


def test_equal_rewards_give_exact_zero_even_when_the_mean_rounds():
    # mean of three 0.1s is not exactly 0.1 in floating point; the advantage must still be exactly 0
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]], dtype=torch.float64)
    assert (rewards - rewards.mean(-1, keepdim=True)).abs().max() > 0  # the trap is real
    adv = group_advantages(rewards)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert torch.equal(group_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))  # G = 1


def test_bad_inputs_raise_with_names():
    with pytest.raises(ValueError, match="num_prompts, G"):
        group_advantages(torch.zeros(8))
    with pytest.raises(ValueError, match="rewards holds 1 non-finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


def test_informative_groups():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    assert informative_groups(rewards).tolist() == [False, True, False]


def test_overlong_penalty_piecewise():
    lengths = torch.tensor([0, 100, 120, 150, 200, 250])
    pen = overlong_penalty(lengths, max_len=200, buffer_len=80, factor=1.0)
    # start of the ramp at 120: 0 up to it, -(L-120)/80 until 200, -1 beyond
    assert pen.tolist() == pytest.approx([0.0, 0.0, 0.0, -30 / 80, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=20)
