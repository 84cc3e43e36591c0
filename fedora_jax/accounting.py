"""Privacy accounting of a run's rounds of user-level DP (the DP plug-in, algorithms/dp.py),
with Google's `dp-accounting` package: epsilon after each round, and the noise multiplier
that meets a target epsilon.

One round of DP-FedAvg releases sum_k clip_C(update_k) + N(0, (z C)^2 I) over the round's
cohort (McMahan, Ramage, Talwar, Zhang. "Learning Differentially Private Recurrent
Language Models." ICLR 2018, https://arxiv.org/abs/1710.06963). What a round costs depends
on how its cohort is drawn and on which pairs of datasets count as neighbours:

  * "poisson": each of the K clients takes part independently with probability q.
    Neighbours: one client's data added or removed. The sum's L2 sensitivity is C, so
    the round is the Poisson-subsampled Gaussian mechanism with noise multiplier z
    (dp_accounting.PoissonSampledDpEvent; q = 1: the Gaussian mechanism).
  * "fixed": exactly M of the K clients, drawn uniformly without replacement (the
    engine's --participation). K is public, so neighbours replace one client's data by
    any other's: the sum moves by at most 2C, and the round is the Gaussian mechanism
    with noise multiplier z / 2 on a sample without replacement
    (SampledWithoutReplacementDpEvent, RDP only: Wang, Balle, Kasiviswanathan, AISTATS
    2019; M = K: the Gaussian mechanism of sensitivity 2C).

Accountants: "rdp" (Renyi DP, Mironov 2017; dp-accounting's conversion to (epsilon,
delta)) and "pld" (privacy loss distributions, Koskela et al. 2020 / Doroshenko et al.
2022; pessimistic discretisation, so an upper bound). dp-accounting's PLD has no
fixed-size sampling: "pld" with M < K is refused (ConfigError).
"""

import math
from typing import NamedTuple

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from fedora_jax.errors import ConfigError

SAMPLINGS = ("fixed", "poisson")
ACCOUNTANTS = ("rdp", "pld")
# The PLD's value discretisation: pessimistic, so epsilon is an upper bound. 1e-3 (not the
# package's 1e-4) keeps a 500-round ledger to seconds. Over 50 to 500 rounds the two
# agree to 2e-5 relative (tests/test_accounting.py); over Abadi et al.'s 10000 steps
# 1e-3 reads 1.4 % higher.
PLD_DISCRETIZATION = 1e-3
_NEIGHBOURS = dp_accounting.NeighboringRelation


class RoundSampling(NamedTuple):
  """How each round's cohort is drawn."""
  kind: str            # "fixed" or "poisson"
  num_clients: int     # K
  expected: float      # fixed: M, the cohort every round; poisson: q K, its mean

  @property
  def rate(self) -> float:
    """q: the chance that a given client takes part in a round."""
    return self.expected / self.num_clients


def check_sampling(sampling: RoundSampling, accountant: str) -> None:
  """One-line ConfigError for a sampling the accountant cannot take."""
  if sampling.kind not in SAMPLINGS:
    raise ConfigError(f"DP sampling must be one of {', '.join(SAMPLINGS)}, got {sampling.kind!r}")
  if accountant not in ACCOUNTANTS:
    raise ConfigError(f"--dp_accountant must be one of {', '.join(ACCOUNTANTS)}, got"
                      f" {accountant!r}")
  if sampling.num_clients < 1 or not 0 < sampling.expected <= sampling.num_clients:
    raise ConfigError(f"DP sampling of {sampling.expected:g} of {sampling.num_clients}"
                      " clients a round: needs 0 < expected <= K")
  if sampling.kind == "fixed" and sampling.expected != int(sampling.expected):
    raise ConfigError(f"fixed-size DP sampling needs a whole cohort, got {sampling.expected}")
  if accountant == "pld" and sampling.kind == "fixed" and sampling.rate < 1:
    raise ConfigError("--dp_accountant=pld accounts for Poisson sampling only (dp-accounting's"
                      " PLD has no fixed-size sampling): use --dp_sampling=poisson, or"
                      " --dp_accountant=rdp, or --participation=1")


def round_event(noise_multiplier: float, sampling: RoundSampling) -> dp_accounting.DpEvent:
  """One round's DpEvent: the sum's Gaussian noise over its sensitivity, subsampled."""
  if sampling.kind == "fixed":
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)  # sensitivity 2C
    if sampling.rate == 1:
      return gaussian
    return dp_accounting.SampledWithoutReplacementDpEvent(
        sampling.num_clients, int(sampling.expected), gaussian)
  gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
  if sampling.rate == 1:
    return gaussian
  return dp_accounting.PoissonSampledDpEvent(sampling.rate, gaussian)


def _neighbours(sampling: RoundSampling):
  # Sampling without replacement is analysed under replace-one (the sensitivity 2C is in
  # the event's noise multiplier); every other event here under add-or-remove-one.
  if sampling.kind == "fixed" and sampling.rate < 1:
    return _NEIGHBOURS.REPLACE_ONE
  return _NEIGHBOURS.ADD_OR_REMOVE_ONE


def new_accountant(accountant: str, sampling: RoundSampling) -> dp_accounting.PrivacyAccountant:
  """A fresh dp-accounting accountant for rounds drawn as `sampling`."""
  check_sampling(sampling, accountant)
  if accountant == "rdp":
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=_neighbours(sampling))
  return dp_accounting.pld.PLDAccountant(_neighbours(sampling),
                                         value_discretization_interval=PLD_DISCRETIZATION)


def epsilon(noise_multiplier: float, rounds: int, delta: float, sampling: RoundSampling,
            accountant: str = "rdp") -> float:
  """Epsilon at `delta` after `rounds` rounds (inf without noise)."""
  if noise_multiplier == 0:
    return math.inf
  ledger = new_accountant(accountant, sampling)
  ledger.compose(round_event(noise_multiplier, sampling), rounds)
  return float(ledger.get_epsilon(delta))


def epsilons(noise_multiplier: float, rounds: int, delta: float, sampling: RoundSampling,
             accountant: str = "rdp") -> np.ndarray:
  """[rounds]: epsilon at `delta` after each round 1..rounds (the ledger rounds.csv shows).

  RDP composes additively: one round's curve, scaled, gives every round's epsilon. PLD:
  one round's distribution self-composed r times for each r (epsilon() composes the same
  way; tests/test_accounting.py checks both against it)."""
  if noise_multiplier == 0:
    return np.full(rounds, np.inf)
  event = round_event(noise_multiplier, sampling)
  counts = np.arange(1, rounds + 1)
  if accountant == "rdp":
    ledger = new_accountant(accountant, sampling)
    ledger.compose(event, 1)
    orders, per_round = np.asarray(ledger._orders), np.asarray(ledger._rdp)  # pylint: disable=protected-access
    return np.array([rdp_privacy_accountant.compute_epsilon(orders, r * per_round, delta)[0]
                     for r in counts])
  check_sampling(sampling, accountant)
  gaussian = event if isinstance(event, dp_accounting.GaussianDpEvent) else event.event
  one_round = privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=gaussian.noise_multiplier,
      value_discretization_interval=PLD_DISCRETIZATION, sampling_prob=sampling.rate,
      neighboring_relation=_neighbours(sampling))
  return np.array([one_round.self_compose(int(r)).get_epsilon_for_delta(delta)
                   for r in counts])


def noise_for_epsilon(target_epsilon: float, rounds: int, delta: float,
                      sampling: RoundSampling, accountant: str = "rdp") -> float:
  """The smallest noise multiplier z (within 1e-4) whose `rounds` rounds reach at most
  `target_epsilon` at `delta` (dp-accounting's calibrate_dp_mechanism: Brent's method,
  then a step to the safe side).

  PLD is searched between a quarter of RDP's answer and RDP's answer (PLD is the tighter
  bound): a PLD of a tiny noise multiplier is too large to build."""
  check_sampling(sampling, accountant)
  z_rdp = _calibrate(target_epsilon, rounds, delta, sampling, "rdp",
                     dp_accounting.LowerEndpointAndGuess(1e-3, 1.0))
  if accountant == "rdp":
    return z_rdp
  return _calibrate(target_epsilon, rounds, delta, sampling, accountant,
                    dp_accounting.ExplicitBracketInterval(max(z_rdp / 4, 0.05), z_rdp))


def _calibrate(target_epsilon: float, rounds: int, delta: float, sampling: RoundSampling,
               accountant: str, bracket) -> float:
  try:
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: new_accountant(accountant, sampling),
        lambda z: dp_accounting.SelfComposedDpEvent(round_event(z, sampling), rounds),
        target_epsilon, delta, bracket_interval=bracket, tol=1e-4))
  except (dp_accounting.mechanism_calibration.NoBracketIntervalFoundError, ValueError):
    raise ConfigError(f"no noise multiplier found for epsilon {target_epsilon:g} at delta"
                      f" {delta:g} over {rounds} rounds ({accountant})") from None
