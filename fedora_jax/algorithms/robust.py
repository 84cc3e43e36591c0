"""Byzantine-robust aggregation of the shared part, as a plug-in for the server step of any
algorithm with a shared part (--aggregation=median|trimmed_mean|krum|multi_krum|
centered_clip|norm_bound; ConFREE, confree.py, is the other aggregation plug-in).

Yin, Chen, Ramchandran, Bartlett. ICML 2018 (median, trimmed_mean). Blanchard, El Mhamdi,
Guerraoui, Stainer. NeurIPS 2017 (krum, multi_krum). Karimireddy, He, Jaggi. ICML 2021
(centered_clip). Sun, Kairouz, Suresh, McMahan. arXiv:1911.07963, 2019 (norm_bound).

The server moves its shared parameters theta by a robust aggregate of the uploaders'
updates g_i = theta_i - theta in place of their weighted mean; the host's training and
the rest of its server are untouched. RobustConfig: rule "median", beta 0.1 (trimmed at
each end), byzantine -1 (f from the --attackers fraction), m 0 (n - f), tau 1.0, iterations
1, start "previous", bound 1.0; check_tolerance refuses a run a rule cannot tolerate.

Departures: median, trimmed_mean, multi_krum and centered_clip take the clients' weights
(the papers' rules are uniform; equal weights give them); Krum is a selection, unweighted.

Details (every option, the departures, measurements): docs/algorithms/robust.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm
from fedora_jax.algorithms.extended_server import Extended, extend_server
from fedora_jax.algorithms.plugin_fields import SharedPart
from fedora_jax.errors import ConfigError, FieldError

PyTree = Any
RULES = ("median", "trimmed_mean", "krum", "multi_krum", "centered_clip", "norm_bound")
_TINY = 1e-12


class RobustConfig(NamedTuple):
  rule: str = "median"
  beta: float = 0.1          # trimmed_mean: fraction trimmed at each end
  byzantine: float = -1.0    # krum, multi_krum: f / n; -1: the --attackers fraction
  m: int = 0                 # multi_krum: updates averaged; 0: n - f
  tau: float = 1.0           # centered_clip: clipping radius
  iterations: int = 1        # centered_clip: clipping steps L
  start: str = "previous"    # centered_clip: "previous" round's aggregate (paper) or "zero"
  bound: float = 1.0         # norm_bound: largest update norm M


# Flags --robust_<field>; `rule` is --aggregation itself.
FLAG_HELP = {
    "beta": "trimmed_mean: the fraction of values trimmed at each end of every"
            " coordinate (Yin et al. 2018's beta)",
    "byzantine": "krum, multi_krum: f, the Byzantine uploads tolerated, as a fraction of"
                 " the round's uploaders; -1: the --attackers fraction (0 without)",
    "m": "multi_krum: the number of lowest-score updates averaged; 0: n - f",
    "tau": "centered_clip: the clipping radius tau (Karimireddy et al. 2021)",
    "iterations": "centered_clip: the clipping steps L",
    "start": "centered_clip: previous (from the previous round's aggregate, the paper's"
             " momentum) or zero (from no move)",
    "bound": "norm_bound: the largest norm M of an update (Sun et al. 2019)",
}


def validate(config: RobustConfig) -> RobustConfig:
  if config.rule not in RULES:
    raise FieldError("robust", "rule", f"must be one of {', '.join(RULES)}, got {config.rule!r}")
  if not 0.0 <= config.beta < 0.5:
    raise FieldError("robust", "beta", f"must be in [0, 0.5), got {config.beta}")
  if config.byzantine != -1.0 and not 0.0 <= config.byzantine < 0.5:
    raise FieldError("robust", "byzantine", f"must be in [0, 0.5) or -1, got {config.byzantine}")
  if config.m < 0:
    raise FieldError("robust", "m", f"must be >= 0, got {config.m}")
  if config.tau <= 0:
    raise FieldError("robust", "tau", f"must be > 0, got {config.tau}")
  if config.iterations < 1:
    raise FieldError("robust", "iterations", f"must be >= 1, got {config.iterations}")
  if config.start not in ("previous", "zero"):
    raise FieldError("robust", "start", f"must be previous or zero, got {config.start!r}")
  if config.bound <= 0:
    raise FieldError("robust", "bound", f"must be > 0, got {config.bound}")
  return config


def resolve(config: RobustConfig, attackers: float) -> RobustConfig:
  """byzantine=-1 made the attackers' fraction (`attackers`, 0 without any)."""
  return config._replace(byzantine=attackers) if config.byzantine == -1.0 else config


def num_byzantine(fraction, num_uploads):
  """f of a round: the fraction of its n uploads, rounded (works on ints and arrays)."""
  if isinstance(num_uploads, int):
    return int(round(fraction * num_uploads))
  return jnp.round(fraction * num_uploads).astype(jnp.int32)


def check_tolerance(config: RobustConfig, attackers: float, num_uploads: int) -> None:
  """One-line ConfigError where `config.rule`, with `num_uploads` uploads a round, cannot
  tolerate the run's `attackers` (the fraction of clients that attack)."""
  config = resolve(config, attackers)
  rule, expected = config.rule, int(round(attackers * num_uploads))
  if rule in ("krum", "multi_krum"):
    f = num_byzantine(config.byzantine, num_uploads)
    if num_uploads <= 2 * f + 2:
      raise ConfigError(f"--aggregation={rule} needs n > 2f + 2 uploads a round; this run"
                        f" has n = {num_uploads} and f = {f} (round({config.byzantine:g} n):"
                        " --robust_byzantine, by default the --attackers fraction)")
    if expected > f:
      raise ConfigError(f"--aggregation={rule} tolerates f = {f} of {num_uploads} uploads a"
                        f" round, fewer than the {expected} attackers of --attackers"
                        f" {attackers:g}: raise --robust_byzantine")
    if config.m > num_uploads - f:
      raise ConfigError(f"--robust_m must be at most n - f = {num_uploads - f}, got {config.m}")
  elif rule == "median" and attackers >= 0.5:
    raise ConfigError(f"--aggregation=median tolerates fewer than half the uploads"
                      f" Byzantine; --attackers is {attackers:g}")
  elif rule == "trimmed_mean" and expected > _trimmed(config.beta, num_uploads):
    raise ConfigError(f"--aggregation=trimmed_mean trims {_trimmed(config.beta, num_uploads)} of"
                      f" {num_uploads} values at each end (--robust_beta {config.beta:g}),"
                      f" fewer than the {expected} attackers of --attackers {attackers:g}")
  elif rule in ("centered_clip", "norm_bound") and attackers >= 0.5:
    # No bound of their own, but half or more Byzantine uploads can pass for the honest
    # ones: no aggregation rule tolerates them (the median's bound is every rule's).
    raise ConfigError(f"--aggregation={rule} cannot tolerate half or more of the uploads"
                      f" Byzantine (they can pass for the honest ones, whatever the rule);"
                      f" --attackers is {attackers:g}")


def _trimmed(beta: float, num_uploads):
  """floor(beta n), the values trimmed at each end; the slack keeps a product that
  float32 puts just below an integer (0.45 * 20) on it."""
  if isinstance(num_uploads, int):
    return int(beta * num_uploads + 1e-3)
  return jnp.floor(beta * num_uploads + 1e-3).astype(jnp.int32)


def _flat(leaf: jax.Array) -> jax.Array:
  return leaf.reshape(leaf.shape[0], -1)


def _sorted(leaf: jax.Array, weights: jax.Array, uploaded: jax.Array):
  """[K, d] values sorted along the client axis, the non-uploaders' last (+inf), and each
  value's weight [K, d] (0 for non-uploaders)."""
  values = jnp.where(uploaded[:, None], _flat(leaf), jnp.inf)
  order = jnp.argsort(values, axis=0)
  return (jnp.take_along_axis(values, order, axis=0),
          jnp.where(uploaded, weights, 0.0)[order])


def coordinate_median(updates: PyTree, weights: jax.Array) -> PyTree:
  """The weighted coordinate-wise median over the uploaders (weights > 0)."""
  uploaded = weights > 0

  def median(leaf):
    values, value_weights = _sorted(leaf, weights, uploaded)
    cumulative = jnp.cumsum(value_weights, axis=0)
    half = cumulative[-1] / 2
    slack = 1e-6 * cumulative[-1]  # equal weights' sums are exact only up to rounding
    lower = jnp.argmax(cumulative >= half - slack, axis=0)
    upper = jnp.argmax(cumulative > half + slack, axis=0)
    pick = lambda index: jnp.take_along_axis(values, index[None], axis=0)[0]
    middle = (pick(lower) + pick(upper)) / 2
    return jnp.where(cumulative[-1] > 0, middle, 0.0).reshape(leaf.shape[1:])
  return jax.tree.map(median, updates)


def trimmed_mean(updates: PyTree, weights: jax.Array, beta: float) -> PyTree:
  """Per coordinate, the weighted mean of the uploaders' values left after dropping the
  floor(beta n) largest and smallest."""
  uploaded = weights > 0
  n = jnp.sum(uploaded)
  trim = _trimmed(beta, n)

  def mean(leaf):
    values, value_weights = _sorted(leaf, weights, uploaded)
    rank = jnp.arange(values.shape[0])[:, None]
    kept = (rank >= trim) & (rank < n - trim)
    total = jnp.sum(jnp.where(kept, value_weights, 0.0), axis=0)
    summed = jnp.sum(jnp.where(kept, values * value_weights, 0.0), axis=0)
    return (summed / jnp.maximum(total, _TINY)).reshape(leaf.shape[1:])
  return jax.tree.map(mean, updates)


def krum_scores(updates: PyTree, weights: jax.Array, byzantine: float) -> jax.Array:
  """[K]: each uploader's sum of squared distances to its n - f - 2 nearest other
  uploaders (Blanchard et al.'s score); +inf for the others."""
  uploaded = weights > 0
  n = jnp.sum(uploaded)
  neighbours = jnp.maximum(n - num_byzantine(byzantine, n) - 2, 1)
  distances = tree.pairwise_squared_distances(updates)
  num = distances.shape[0]
  others = uploaded[None, :] & ~jnp.eye(num, dtype=bool)
  nearest = jnp.sort(jnp.where(others, distances, jnp.inf), axis=1)
  counted = jnp.arange(num)[None, :] < neighbours
  scores = jnp.sum(jnp.where(counted, nearest, 0.0), axis=1)
  return jnp.where(uploaded, scores, jnp.inf)


def krum(updates: PyTree, weights: jax.Array, byzantine: float) -> PyTree:
  """The uploaded update of lowest Krum score (a selection: weights cannot enter)."""
  return tree.take(updates, jnp.argmin(krum_scores(updates, weights, byzantine)))


def multi_krum(updates: PyTree, weights: jax.Array, byzantine: float, m: int = 0) -> PyTree:
  """The weighted mean of the m uploaded updates of lowest Krum score (m = 0: n - f)."""
  scores = krum_scores(updates, weights, byzantine)
  n = jnp.sum(weights > 0)
  count = n - num_byzantine(byzantine, n) if m == 0 else jnp.minimum(m, n)
  rank = jnp.argsort(jnp.argsort(scores))
  chosen = (rank < jnp.maximum(count, 1)) & (weights > 0)
  return tree.weighted_mean(updates, jnp.where(chosen, weights, 0.0))


def _norms(stacked: PyTree) -> jax.Array:
  """[K]: each stacked model's Euclidean norm over all its leaves."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(_flat(leaf)), axis=1)
                      for leaf in jax.tree.leaves(stacked)))


def _clip_factors(norms: jax.Array, radius) -> jax.Array:
  return jnp.minimum(1.0, radius / jnp.maximum(norms, _TINY))


def centered_clip(updates: PyTree, weights: jax.Array, start: PyTree, tau: float,
                  iterations: int) -> PyTree:
  """`iterations` steps of v <- v + sum_i w_i clip_tau(g_i - v) / sum_i w_i from `start`."""
  weights = jnp.where(weights > 0, weights, 0.0)
  share = weights / jnp.maximum(jnp.sum(weights), _TINY)

  def step(_, center):
    offsets = jax.tree.map(lambda g, v: g - v[None], updates, center)
    scale = share * _clip_factors(_norms(offsets), tau)
    return jax.tree.map(lambda v, d: v + jnp.tensordot(scale, d, axes=(0, 0)), center,
                        offsets)
  return jax.lax.fori_loop(0, iterations, step, start)


def norm_bounded_mean(updates: PyTree, weights: jax.Array, bound: float) -> PyTree:
  """The weighted mean of the updates, each scaled to norm at most `bound`."""
  weights = jnp.where(weights > 0, weights, 0.0)
  scale = weights * _clip_factors(_norms(updates), bound)
  return jax.tree.map(lambda d: jnp.tensordot(scale, d, axes=(0, 0)) /
                      jnp.maximum(jnp.sum(weights), _TINY), updates)


def robust_step(updates: PyTree, weights: jax.Array, config: RobustConfig,
                previous: PyTree | None = None) -> PyTree:
  """The move of theta by `config.rule` from the stacked updates [K, ...] (only weights > 0
  count); `previous`: centered clipping's start (None: zero)."""
  rule = config.rule
  if rule == "median":
    return coordinate_median(updates, weights)
  if rule == "trimmed_mean":
    return trimmed_mean(updates, weights, config.beta)
  if rule == "krum":
    return krum(updates, weights, config.byzantine)
  if rule == "multi_krum":
    return multi_krum(updates, weights, config.byzantine, config.m)
  if rule == "centered_clip":
    start = previous if previous is not None else jax.tree.map(
        lambda leaf: jnp.zeros(leaf.shape[1:], leaf.dtype), updates)
    return centered_clip(updates, weights, start, config.tau, config.iterations)
  return norm_bounded_mean(updates, weights, config.bound)


def with_robust(host: Algorithm, config: RobustConfig, attackers: float = 0.0,
                name: str | None = None) -> Algorithm:
  """The host with theta, its server's shared parameters (where its `shared_part` says),
  moved by `config.rule` over the round's uploads instead of the mean. `attackers`: the
  run's attacker fraction, f's default."""
  config = resolve(validate(config), attackers)
  shared: SharedPart | None = host.shared_part
  if shared is None:
    raise ConfigError(f"--aggregation={config.rule} needs an algorithm whose server averages"
                      f" a shared part; {host.name} declares none (Algorithm.shared_part)")
  keeps_previous = config.rule == "centered_clip" and config.start == "previous"

  def step(server, uploads, weights, previous):
    theta, uploaded = shared.of_server(server), shared.of_uploads(uploads)
    if jax.tree.structure(theta) != jax.tree.structure(uploaded):
      raise ConfigError(f"--aggregation={config.rule}: {host.name}'s server state is not"
                        " the shared model its clients upload")
    updates = jax.tree.map(lambda upload, g: upload - g[None], uploaded, theta)
    return theta, robust_step(updates, weights, config, previous)

  def aggregate(server, clients, uploads, weights):
    state = host.aggregate(server, clients, uploads, weights)
    theta, move = step(server, uploads, weights, None)
    return state._replace(server=shared.replace(state.server,
                                                jax.tree.map(jnp.add, theta, move)))

  name = name or f"{host.name}+{config.rule}"
  if not keeps_previous:
    # Sorts, selections and sums over the uploads: order-free, no client state read.
    return host._replace(name=name, aggregate=aggregate)

  def zero_move(context, state):
    del context
    return jax.tree.map(jnp.zeros_like, shared.of_server(state.server))
  extended = extend_server(host, zero_move, name)

  def aggregate_from_previous(server: Extended, clients, uploads, weights):
    state = host.aggregate(server.host, clients, uploads, weights)
    theta, move = step(server.host, uploads, weights, server.extra)
    moved = shared.replace(state.server, jax.tree.map(jnp.add, theta, move))
    return state._replace(server=Extended(moved, move))
  return extended._replace(aggregate=aggregate_from_previous)
