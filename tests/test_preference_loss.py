"""The preference losses against the published formulas, computed here in plain Python on fixed log-probabilities,
and against TRL's own loss code on the same inputs."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from qlora_fsdp.losses.pair_formulas import PairLogps, dpo_losses, orpo_odds_ratio_losses, simpo_losses

# four pairs: summed log-probabilities of the chosen and rejected completions, and their lengths in tokens
POLICY = ([-12.5, -30.0, -7.25, -50.0], [-14.0, -22.5, -9.0, -49.0], [10, 24, 5, 40], [12, 18, 7, 38])
REFERENCE = ([-13.0, -29.0, -8.0, -51.5], [-13.5, -23.0, -8.5, -48.0])


def pairs(chosen, rejected, chosen_tokens=POLICY[2], rejected_tokens=POLICY[3]) -> PairLogps:
    def t(values):
        return torch.tensor(values, dtype=torch.float64)

    return PairLogps(t(chosen), t(rejected), t(chosen_tokens), t(rejected_tokens))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def dpo_by_hand(i: int, beta: float, loss_type: str, smoothing: float) -> float:
    pc, pr, nc, nr = (column[i] for column in POLICY)
    rc, rr = (column[i] for column in REFERENCE)
    if loss_type == "ipo":  # per-token averages
        h = (pc - rc) / nc - (pr - rr) / nr
        return (h - 1 / (2 * beta)) ** 2
    z = beta * ((pc - rc) - (pr - rr))
    if loss_type == "sigmoid":
        return -(1 - smoothing) * log_sigmoid(z) - smoothing * log_sigmoid(-z)
    if loss_type == "robust":
        return (-(1 - smoothing) * log_sigmoid(z) + smoothing * log_sigmoid(-z)) / (1 - 2 * smoothing)
    assert loss_type == "hinge"
    return max(0.0, 1 - z)


@pytest.mark.parametrize(("loss_type", "beta", "smoothing"), [
    ("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("robust", 0.1, 0.1), ("hinge", 0.3, 0.0), ("ipo", 0.1, 0.0)])
def test_dpo_losses_are_the_published_formulas(loss_type, beta, smoothing):
    losses, rewards = dpo_losses(pairs(*POLICY), pairs(*REFERENCE), beta, loss_type, smoothing)
    expected = [dpo_by_hand(i, beta, loss_type, smoothing) for i in range(4)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    if loss_type != "ipo":
        by_hand = [beta * (p - r) for p, r in zip(POLICY[0], REFERENCE[0], strict=True)]
        assert rewards.chosen.tolist() == pytest.approx(by_hand)
        assert rewards.correct.tolist() == [float(m > 0) + 0.5 * (m == 0) for m in rewards.margin.tolist()]


def test_dpo_is_log_2_where_policy_equals_reference():
    for loss_type in ("sigmoid", "robust"):
        losses, rewards = dpo_losses(pairs(*POLICY), pairs(*POLICY), 0.1, loss_type, 0.0)
        assert losses.tolist() == [math.log(2)] * 4
        assert rewards.margin.tolist() == [0.0] * 4 and rewards.correct.tolist() == [0.5] * 4  # a tie: no preference


def test_simpo_and_orpo_are_the_published_formulas():
    beta, gamma, weight = 2.0, 0.5, 0.1
    simpo, _ = simpo_losses(pairs(*POLICY), beta, gamma, label_smoothing=0.0)
    orpo, _ = orpo_odds_ratio_losses(pairs(*POLICY), weight)
    for i in range(4):
        ac, ar = POLICY[0][i] / POLICY[2][i], POLICY[1][i] / POLICY[3][i]
        assert simpo[i].item() == pytest.approx(-log_sigmoid(beta * (ac - ar) - gamma), rel=1e-12)
        odds = math.log(math.exp(ac) / (1 - math.exp(ac))) - math.log(math.exp(ar) / (1 - math.exp(ar)))
        assert orpo[i].item() == pytest.approx(-weight * log_sigmoid(odds), rel=1e-10)


def trl_trainer_self(**settings) -> SimpleNamespace:
    """What TRL's loss methods read of their trainer."""
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), alpha=0.0, **settings)


@pytest.fixture(scope="module")
def trl_trainers():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    return CPOTrainer, ORPOTrainer


def test_simpo_orpo_and_reference_free_dpo_equal_trls_loss_code(trl_trainers):
    """TRL's CPO trainer computes SimPO, and (its reference being none) DPO's sigmoid, hinge and IPO losses against
    a reference of zeros; its ORPO trainer the odds-ratio term. Both take per-token averages where the loss uses
    them (TRL averages in its forward)."""
    cpo, orpo_trainer = trl_trainers
    policy = pairs(*POLICY)
    average = policy.averaged()
    zeros = pairs([0.0] * 4, [0.0] * 4)
    for loss_type, smoothing in (("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)):
        settings = trl_trainer_self(beta=0.3, loss_type=loss_type, label_smoothing=smoothing)
        trl_input = average if loss_type == "ipo" else policy
        theirs, chosen, rejected = cpo.cpo_loss(settings, trl_input.chosen, trl_input.rejected)
        ours, rewards = dpo_losses(policy, zeros, 0.3, loss_type, smoothing)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        if loss_type != "ipo":
            torch.testing.assert_close(rewards.chosen, chosen)
            torch.testing.assert_close(rewards.rejected, rejected)

    settings = trl_trainer_self(beta=2.0, loss_type="simpo", simpo_gamma=0.5, label_smoothing=0.1)
    theirs, chosen, rejected = cpo.cpo_loss(settings, average.chosen, average.rejected)
    ours, rewards = simpo_losses(policy, 2.0, 0.5, label_smoothing=0.1)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards.chosen, chosen)

    theirs_ratio, chosen, rejected, _, _ = orpo_trainer.odds_ratio_loss(trl_trainer_self(beta=0.1), average.chosen,
                                                                         average.rejected)
    ours, rewards = orpo_odds_ratio_losses(policy, 0.1)
    torch.testing.assert_close(ours, -theirs_ratio.double(), rtol=1e-6, atol=1e-9)  # TRL computes in float32
    torch.testing.assert_close(rewards.chosen, chosen.double(), rtol=1e-6, atol=1e-9)


def test_gradients_flow_to_the_policy_only():
    fixed = pairs(*POLICY)
    chosen = fixed.chosen.clone().requires_grad_()
    policy = PairLogps(chosen, fixed.rejected, fixed.chosen_tokens, fixed.rejected_tokens)
    losses, rewards = dpo_losses(policy, pairs(*REFERENCE), 0.1)
    losses.sum().backward()
    assert chosen.grad is not None and (chosen.grad < 0).all()  # raising the chosen log-probability lowers the loss
    assert not rewards.chosen.requires_grad
