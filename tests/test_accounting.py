"""The privacy accountant (fedora_jax/accounting.py): against dp-accounting's own events,
against an RDP curve computed here from its definition, against a published epsilon
(Abadi et al. 2016), and its inverse (the noise for a target epsilon)."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.special import comb, logsumexp

from fedora_jax import accounting
from fedora_jax.accounting import RoundSampling
from fedora_jax.errors import ConfigError


def subsampled_gaussian_rdp(q: float, sigma: float, alpha: int) -> float:
  """RDP at integer order alpha of the Poisson-subsampled Gaussian mechanism (Mironov,
  Talwar, Zhang 2019, Sec. 3.3): log(sum_k C(alpha,k) (1-q)^(alpha-k) q^k
  exp((k^2 - k) / (2 sigma^2))) / (alpha - 1)."""
  k = np.arange(alpha + 1)
  terms = (np.log(comb(alpha, k)) + (alpha - k) * math.log1p(-q) + k * math.log(q)
           + (k * k - k) / (2 * sigma ** 2))
  return float(logsumexp(terms)) / (alpha - 1)


def test_abadi_et_al_mnist_epsilon():
  """Abadi et al. 2016 ("Deep Learning with Differential Privacy", CCS), Sec. 3.1: q =
  0.01, sigma = 4, delta = 1e-5, T = 10000 steps give epsilon ~ 1.26 with the moments
  accountant. Its conversion, eps = min over lambda <= 32 of (T alpha(lambda) +
  log(1/delta)) / lambda with alpha(lambda) = lambda RDP(lambda + 1), on the RDP curve
  computed here gives 1.26; our accountant's tighter conversions give less."""
  q, sigma, steps, delta = 0.01, 4.0, 10_000, 1e-5
  moments = min((steps * lam * subsampled_gaussian_rdp(q, sigma, lam + 1) + math.log(1 / delta))
                / lam for lam in range(1, 33))
  assert round(moments, 2) == 1.26
  # Clients are the records here: K = 100, each drawn with probability 0.01.
  sampling = RoundSampling("poisson", 100, 1.0)
  rdp = accounting.epsilon(sigma, steps, delta, sampling, "rdp")
  pld = accounting.epsilon(sigma, steps, delta, sampling, "pld")
  assert 0.9 < pld < rdp < moments
  np.testing.assert_allclose(rdp, 1.0355, atol=1e-4)  # dp-accounting's RDP conversion


def test_rdp_curve_is_the_subsampled_gaussian_of_its_definition():
  ledger = rdp_privacy_accountant.RdpAccountant(orders=list(range(2, 40)))
  ledger.compose(accounting.round_event(1.3, RoundSampling("poisson", 50, 10.0)), 1)
  expected = [subsampled_gaussian_rdp(0.2, 1.3, alpha) for alpha in range(2, 40)]
  np.testing.assert_allclose(ledger._rdp, expected, rtol=1e-10)  # pylint: disable=protected-access


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_poisson_rounds_against_dp_accounting(accountant):
  q, z, rounds, delta = 0.25, 1.1, 40, 1e-6
  ledger = (rdp_privacy_accountant.RdpAccountant() if accountant == "rdp" else
            pld_privacy_accountant.PLDAccountant(
                value_discretization_interval=accounting.PLD_DISCRETIZATION))
  ledger.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
                 rounds)
  sampling = RoundSampling("poisson", 40, 10.0)
  assert accounting.epsilon(z, rounds, delta, sampling, accountant) == pytest.approx(
      ledger.get_epsilon(delta), rel=1e-12)
  per_round = accounting.epsilons(z, rounds, delta, sampling, accountant)
  assert per_round.shape == (rounds,) and (np.diff(per_round) > 0).all()
  np.testing.assert_allclose(per_round[-1], ledger.get_epsilon(delta), rtol=1e-9)
  np.testing.assert_allclose(per_round[9], accounting.epsilon(z, 10, delta, sampling, accountant),
                             rtol=1e-9)


def test_fixed_size_rounds_are_sampled_without_replacement_at_half_the_noise():
  """M of K clients, K public: replace-one neighbours, so the sum's sensitivity is 2C and
  the round is the Gaussian mechanism of noise multiplier z / 2 on the sample."""
  z, rounds, delta = 3.0, 25, 1e-5
  ledger = rdp_privacy_accountant.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  ledger.compose(dp_accounting.SampledWithoutReplacementDpEvent(
      36, 9, dp_accounting.GaussianDpEvent(z / 2)), rounds)
  sampling = RoundSampling("fixed", 36, 9)
  assert accounting.epsilon(z, rounds, delta, sampling) == pytest.approx(
      ledger.get_epsilon(delta), rel=1e-12)
  np.testing.assert_allclose(accounting.epsilons(z, rounds, delta, sampling)[-1],
                             ledger.get_epsilon(delta), rtol=1e-9)
  # Every client every round: the Gaussian mechanism of sensitivity 2C, whose epsilon has
  # the closed form of Balle & Wang 2018 (dp-accounting's gaussian_mechanism).
  everyone = RoundSampling("fixed", 36, 36)
  exact = dp_accounting.get_epsilon_gaussian(z / 2 / math.sqrt(rounds), delta)
  assert accounting.epsilon(z, rounds, delta, everyone, "pld") == pytest.approx(exact, rel=1e-3)
  assert accounting.epsilon(z, rounds, delta, everyone, "rdp") >= exact


def test_pld_discretisation_is_an_upper_bound_close_to_the_finer_one():
  sampling, z, rounds, delta = RoundSampling("poisson", 20, 10.0), 7.0, 50, 1e-5
  fine = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
  fine.compose(accounting.round_event(z, sampling), rounds)
  ours = accounting.epsilon(z, rounds, delta, sampling, "pld")
  assert fine.get_epsilon(delta) <= ours <= fine.get_epsilon(delta) * (1 + 1e-4)


@pytest.mark.parametrize("sampling,accountant", [
    (RoundSampling("fixed", 36, 18), "rdp"), (RoundSampling("poisson", 36, 18.0), "pld")])
def test_noise_for_epsilon_meets_the_target_from_the_safe_side(sampling, accountant):
  z = accounting.noise_for_epsilon(2.0, 30, 1e-5, sampling, accountant)
  reached = accounting.epsilon(z, 30, 1e-5, sampling, accountant)
  assert 1.99 < reached <= 2.0
  assert accounting.epsilon(z - 1e-3, 30, 1e-5, sampling, accountant) > 2.0


def test_no_noise_is_no_privacy():
  sampling = RoundSampling("poisson", 10, 5.0)
  assert accounting.epsilon(0.0, 3, 1e-5, sampling) == math.inf
  assert np.isinf(accounting.epsilons(0.0, 3, 1e-5, sampling)).all()


def test_pld_refuses_fixed_size_sampling_in_one_line():
  with pytest.raises(ConfigError) as error:
    accounting.epsilon(1.0, 3, 1e-5, RoundSampling("fixed", 10, 5), "pld")
  assert "Poisson sampling only" in str(error.value) and "\n" not in str(error.value)
