"""User-level differential privacy (central DP-FedAvg), as a plug-in for the server mean of
any algorithm whose server reads its clients' uploads only through their mean (--dp_*).

McMahan, Ramage, Talwar, Zhang. "Learning Differentially Private Recurrent Language
Models." ICLR 2018. https://arxiv.org/abs/1710.06963  (DP-FedAvg, Algorithm 1)
Andrew, Thakkar, McMahan, Ramaswamy. "Differentially Private Learning with Adaptive
Clipping." NeurIPS 2021. https://arxiv.org/abs/1905.03871  (adaptive clipping, Alg. 1)

Each round client k clips its update Delta_k = upload_k - theta to L2 norm C (clip_norm);
the server adds N(0, (z C)^2 I) (noise_multiplier z, or from target_epsilon at delta) to
the sum and divides by the expected cohort m; the host's aggregate then runs on uploads
that all equal theta'. Every client counts 1; personal parts never leave the client.
adaptive_clip_quantile gamma moves C towards that quantile of the update norms
(clip_learning_rate 0.2, clipped_count_stddev m / 20); sampling "fixed" (default) or
"poisson"; accountant "rdp" or "pld".

Details (every option, the departures, measurements): docs/algorithms/dp.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax import accounting, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.extended_server import Extended, extend_server
from fedora_jax.algorithms.plugin_fields import UploadMean
from fedora_jax.errors import ConfigError, FieldError

PyTree = Any
_KEY_TAG = 0x4450  # "DP": this plug-in's stream of the algorithm key
_TINY = 1e-12


class DpConfig(NamedTuple):
  clip_norm: float | None = None          # C (with adaptive clipping: its initial value)
  noise_multiplier: float | None = None   # z; None: resolved from target_epsilon
  target_epsilon: float | None = None     # epsilon after the run's rounds, at delta
  delta: float | None = None
  accountant: str = "rdp"                 # "rdp" or "pld" (accounting.py)
  sampling: str = "fixed"                 # "fixed" (the engine's) or "poisson"
  adaptive_clip_quantile: float | None = None  # gamma; None: C stays fixed
  clip_learning_rate: float = 0.2         # eta_C (Andrew et al.)
  clipped_count_stddev: float | None = None    # sigma_b; None: expected_clients / 20
  # Set by `resolve` from the run: m, the cohort the noised sum is divided by (0: the
  # round's clients, counted), and poisson's q.
  expected_clients: float = 0.0
  sampling_rate: float = 1.0


# --dp_<field> flags: the fields a user sets (expected_clients and sampling_rate come
# from the run).
FLAG_HELP = {
    "clip_norm": "DP: L2 norm C each client's update of the shared part is clipped to"
                 " (turns user-level DP on; with adaptive clipping its first value)",
    "noise_multiplier": "DP: z, the Gaussian noise's std over C added to the sum of the"
                        " clipped updates (or give --dp_target_epsilon)",
    "target_epsilon": "DP: the epsilon the run's rounds may reach at --dp_delta; the noise"
                      " multiplier is found for the run's rounds and sampling",
    "delta": "DP: the delta epsilon is reported at (below 1/K for a meaningful guarantee)",
    "accountant": "DP: rdp (Renyi DP) or pld (privacy loss distributions; Poisson"
                  " sampling only)",
    "sampling": "DP: fixed (the engine's round(f K) clients a round, replace-one"
                " adjacency) or poisson (each client with probability --participation,"
                " add/remove adjacency; the engine trains all K a round)",
    "adaptive_clip_quantile": "DP: adapt C towards this quantile of the update norms"
                              " (Andrew et al. 2021; e.g. 0.5); unset: C stays fixed",
    "clip_learning_rate": "DP: eta_C, the geometric step of adaptive clipping",
    "clipped_count_stddev": "DP: sigma_b, the noise on the count of unclipped updates"
                            " (adaptive clipping; default: the expected cohort / 20)",
}


def validate(config: DpConfig) -> DpConfig:
  """One-line FieldErrors (--dp_<field> on the command line) for bad DP settings."""
  if config.clip_norm is None or not config.clip_norm > 0:
    raise FieldError("dp", "clip_norm", f"must be > 0 (it turns DP on), got {config.clip_norm}")
  if config.noise_multiplier is not None and not config.noise_multiplier >= 0:
    raise FieldError("dp", "noise_multiplier", f"must be >= 0, got {config.noise_multiplier}")
  if config.target_epsilon is not None and not config.target_epsilon > 0:
    raise FieldError("dp", "target_epsilon", f"must be > 0, got {config.target_epsilon}")
  if config.noise_multiplier is None and config.target_epsilon is None:
    raise ConfigError("DP needs --dp_noise_multiplier or --dp_target_epsilon")
  if config.delta is None and (config.target_epsilon is not None or config.noise_multiplier):
    given = ("--dp_target_epsilon" if config.target_epsilon is not None
             else "--dp_noise_multiplier")
    raise FieldError("dp", "delta", f"must be given with {given}: epsilon is only defined at"
                                    " a delta (e.g. 1e-5, below 1/K)")
  if config.delta is not None and not 0 < config.delta < 1:
    raise FieldError("dp", "delta", f"must be in (0, 1), got {config.delta}")
  if config.accountant not in accounting.ACCOUNTANTS:
    raise FieldError("dp", "accountant", f"must be one of {', '.join(accounting.ACCOUNTANTS)},"
                                         f" got {config.accountant!r}")
  if config.sampling not in accounting.SAMPLINGS:
    raise FieldError("dp", "sampling", f"must be one of {', '.join(accounting.SAMPLINGS)},"
                                       f" got {config.sampling!r}")
  if config.adaptive_clip_quantile is not None and not 0 < config.adaptive_clip_quantile < 1:
    raise FieldError("dp", "adaptive_clip_quantile",
                     f"must be in (0, 1), got {config.adaptive_clip_quantile}")
  if not config.clip_learning_rate > 0:
    raise FieldError("dp", "clip_learning_rate", f"must be > 0, got {config.clip_learning_rate}")
  if config.clipped_count_stddev is not None and not config.clipped_count_stddev > 0:
    raise FieldError("dp", "clipped_count_stddev",
                     f"must be > 0, got {config.clipped_count_stddev}")
  if not config.expected_clients >= 0:
    raise FieldError("dp", "expected_clients", f"must be >= 0, got {config.expected_clients}")
  if not 0 < config.sampling_rate <= 1:
    raise FieldError("dp", "sampling_rate", f"must be in (0, 1], got {config.sampling_rate}")
  return config


def round_sampling(config: DpConfig, num_clients: int) -> accounting.RoundSampling:
  """How a resolved config's rounds draw their cohort, for the accountant."""
  return accounting.RoundSampling(config.sampling, num_clients, config.expected_clients)


def resolve(config: DpConfig, rounds: int, num_clients: int, participation: float,
            sampled: int) -> DpConfig:
  """The run's DP config: its expected cohort m (fixed: the engine's `sampled` clients a
  round; poisson: q K with q = `participation`), and, from a target epsilon, the noise
  multiplier its `rounds` rounds need. One-line ConfigErrors for what cannot run. A
  resolved config holds both its target and the noise found for it (expected_clients
  set): resolving it again finds the noise for these rounds anew."""
  config = validate(config)
  if config.target_epsilon is not None and config.noise_multiplier is not None:
    if not config.expected_clients:
      raise ConfigError("DP takes one of --dp_noise_multiplier and --dp_target_epsilon,"
                        " got both")
    config = config._replace(noise_multiplier=None)
  if config.sampling == "fixed":
    config = config._replace(expected_clients=float(sampled), sampling_rate=1.0)
  else:
    config = config._replace(expected_clients=participation * num_clients,
                             sampling_rate=participation)
  sampling = round_sampling(config, num_clients)
  accounting.check_sampling(sampling, config.accountant)
  if config.target_epsilon is not None:
    assert config.delta is not None  # validate: a target needs a delta
    config = config._replace(noise_multiplier=accounting.noise_for_epsilon(
        config.target_epsilon, rounds, config.delta, sampling, config.accountant))
  noise_split(config)  # adaptive clipping's noise must leave some for the update
  return config


def epsilons(config: DpConfig, rounds: int, num_clients: int) -> np.ndarray:
  """[rounds]: epsilon at config.delta after each round (a resolved config; inf without
  noise)."""
  assert config.noise_multiplier is not None
  if not config.noise_multiplier:
    return np.full(rounds, np.inf)
  assert config.delta is not None
  return accounting.epsilons(config.noise_multiplier, rounds, config.delta,
                             round_sampling(config, num_clients), config.accountant)


def noise_split(config: DpConfig) -> tuple[float, float]:
  """(z_Delta, sigma_b): the update's noise multiplier and the count's noise std. Without
  adaptive clipping (z, 0); with it, z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (Andrew et
  al., Theorem 1), so the two releases cost what z alone does."""
  z = config.noise_multiplier
  if z is None:
    raise ConfigError("DP: the noise multiplier is not resolved; build DP from"
                      " dp.resolve(config, ...) when giving a target epsilon")
  if config.adaptive_clip_quantile is None:
    return z, 0.0
  sigma_b = config.clipped_count_stddev
  if sigma_b is None:
    if not config.expected_clients:
      raise FieldError("dp", "clipped_count_stddev", "must be given for adaptive clipping"
                                                     " when the expected cohort is not")
    sigma_b = config.expected_clients / 20
  if z == 0:
    return 0.0, sigma_b
  if not 2 * sigma_b > z:
    raise FieldError("dp", "clipped_count_stddev",
                     f"sigma_b = {sigma_b:g} is too small for noise multiplier z = {z:g}:"
                     " adaptive clipping needs 2 sigma_b > z (Andrew et al.: z_update ="
                     " (z^-2 - (2 sigma_b)^-2)^-1/2); raise it or the cohort")
  return 1.0 / math.sqrt(z ** -2 - (2 * sigma_b) ** -2), sigma_b


def global_norm(update: PyTree) -> jax.Array:
  """The L2 norm of a whole pytree, all leaves as one vector."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(update)))


def clip(update: PyTree, clip_norm: jax.Array) -> tuple[PyTree, jax.Array]:
  """(update scaled to L2 norm at most clip_norm, its norm before)."""
  norm = global_norm(update)
  scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, _TINY))
  return jax.tree.map(lambda leaf: leaf * scale, update), norm


def noise_norm(std: jax.Array, like: PyTree, expected_clients: float) -> jax.Array:
  """The expected L2 norm of the noise the server adds to the mean of updates shaped as
  `like` (std z C on the sum, divided by m): z C sqrt(P) / m, P the coordinates; NaN when
  m is the round's count (expected_clients 0), which a client does not know."""
  coordinates = sum(leaf.size for leaf in jax.tree.leaves(like))
  if not expected_clients:
    return jnp.asarray(jnp.nan, jnp.float32)
  return std * math.sqrt(coordinates) / expected_clients


def divergence_hint(extra: dict, round_number: int) -> str | None:
  """For a round whose training diverged, what DP did, from the clients' metrics (`extra`,
  each [K]): when the model they started from carried a release's noise (round 2 on) whose
  norm is at least half that model's, a line saying so; else None (not DP's doing)."""
  if round_number < 2 or "dp_noise_norm" not in extra:
    return None
  noise = float(np.nanmean(extra["dp_noise_norm"]))
  model = float(np.nanmean(extra["dp_received_norm"]))
  if not (math.isfinite(noise) and math.isfinite(model) and noise >= model / 2):
    return None
  return (f"the model the clients trained from (the last release) has norm {model:.3g}"
          f" and the Gaussian noise DP adds to each release has norm {noise:.3g}: training"
          " from a model that is mostly DP noise diverged; at this epsilon the mean needs"
          " a larger cohort or a smaller clip norm")


def gaussian_like(total: PyTree, key: jax.Array, std: jax.Array) -> PyTree:
  """N(0, std^2) noise shaped as `total`, each leaf from its own key."""
  leaves, treedef = jax.tree.flatten(total)
  noise = [std * jax.random.normal(jax.random.fold_in(key, i), leaf.shape, leaf.dtype)
           for i, leaf in enumerate(leaves)]
  return jax.tree.unflatten(treedef, noise)


def adapted_clip_norm(clip_norm: jax.Array, unclipped_fraction: jax.Array, quantile: float,
                      learning_rate: float) -> jax.Array:
  """Andrew et al.'s geometric step: C exp(-eta_C (b - gamma))."""
  return clip_norm * jnp.exp(-learning_rate * (unclipped_fraction - quantile))


class DpState(NamedTuple):
  """The plug-in's server state, beside the host's (extended_server.Extended)."""
  key: jax.Array        # [2] uint32 key data of the plug-in's stream
  round: jax.Array      # [] int32, rounds aggregated so far
  clip_norm: jax.Array  # [] C of the coming round


class DpMessage(NamedTuple):
  host: PyTree          # what the host sends (theta within it: UploadMean.sent)
  clip_norm: jax.Array  # [] C, per client
  included: jax.Array   # [] bool: the client's update counts (Poisson's draw; else True)


class DpUpload(NamedTuple):
  update: PyTree        # the clipped Delta_k
  unclipped: jax.Array  # [] b_k = 1[||Delta_k|| <= C]
  included: jax.Array   # [] 1.0 where the update counts


def _round_keys(state: DpState) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(Poisson's draw, the update's noise, the count's noise) of the round `state` is at."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.round)
  return tuple(jax.random.fold_in(key, i) for i in range(3))  # type: ignore[return-value]


def _sat_out(value: jax.Array, included: jax.Array) -> jax.Array:
  """A client's metric or statistic where its update does not count: NaN, or 0."""
  empty = jnp.nan if jnp.issubdtype(value.dtype, jnp.inexact) else 0
  return jnp.where(included, value, jnp.asarray(empty, value.dtype))


def with_dp(host: Algorithm, config: DpConfig, name: str | None = None) -> Algorithm:
  """The host with its server's mean replaced by DP-FedAvg's noised mean of clipped
  updates (see docs/algorithms/dp.md). `config`: resolved (a noise multiplier given)."""
  config = validate(config)
  mean: UploadMean | None = host.upload_mean
  if mean is None:
    raise ConfigError(f"DP (--dp_*) needs an algorithm whose server averages what its"
                      f" clients upload; {host.name} declares none (Algorithm.upload_mean)")
  update_noise, count_noise = noise_split(config)
  poisson = config.sampling == "poisson"
  adaptive = config.adaptive_clip_quantile is not None

  def init_extra(context: InitContext, state: AlgorithmState) -> DpState:
    del state
    return DpState(key=jax.random.key_data(jax.random.fold_in(context.key, _KEY_TAG)),
                   round=jnp.zeros((), jnp.int32),
                   clip_norm=jnp.asarray(config.clip_norm, jnp.float32))
  extended = extend_server(host, init_extra, name or f"{host.name}+dp")

  def broadcast(server: Extended, clients) -> DpMessage:
    num_clients = tree.leading_size(clients)
    included = jnp.ones((num_clients,), bool)
    if poisson:
      included = jax.random.bernoulli(_round_keys(server.extra)[0], config.sampling_rate,
                                      (num_clients,))
    return DpMessage(host=host.broadcast(server.host, clients),
                     clip_norm=jnp.broadcast_to(server.extra.clip_norm, (num_clients,)),
                     included=included)

  def client_update(client_state, message: DpMessage, data, key) -> ClientOutput:
    out = host.client_update(client_state, message.host, data, key)
    update = jax.tree.map(jnp.subtract, out.upload, mean.sent(message.host))
    clipped, norm = clip(update, message.clip_norm)
    unclipped = (norm <= message.clip_norm).astype(jnp.float32)
    theta = mean.sent(message.host)
    metrics = {**out.metrics, "dp_update_norm": norm, "dp_clipped": 1.0 - unclipped,
               # What a diverged run's line compares (divergence_hint).
               "dp_received_norm": global_norm(theta),
               "dp_noise_norm": noise_norm(update_noise * message.clip_norm, theta,
                                           config.expected_clients)}
    included = message.included
    upload = DpUpload(update=clipped, unclipped=unclipped,
                      included=included.astype(jnp.float32))
    if not poisson:
      return out._replace(upload=upload, metrics=metrics)
    # Not drawn: the client sat the round out (its state as it was, nothing counted).
    state = jax.tree.map(lambda new, old: jnp.where(included, new, old), out.state,
                         client_state)
    return ClientOutput(
        state=state,
        upload=upload._replace(update=jax.tree.map(lambda u: u * included, clipped),
                               unclipped=unclipped * included),
        train=jax.tree.map(lambda v: _sat_out(v, included), out.train),
        metrics={k: _sat_out(v, included) for k, v in metrics.items()})

  def aggregate(server: Extended, clients, uploads: DpUpload, weights) -> AlgorithmState:
    extra: DpState = server.extra
    _, noise_key, count_key = _round_keys(extra)
    counted = (weights > 0).astype(jnp.float32) * uploads.included
    expected = (jnp.asarray(config.expected_clients, jnp.float32) if config.expected_clients
                else jnp.maximum(jnp.sum(counted), 1.0))
    total = jax.tree.map(lambda u: jnp.tensordot(counted, u, axes=1), uploads.update)
    noised = jax.tree.map(jnp.add, total,
                          gaussian_like(total, noise_key, update_noise * extra.clip_norm))
    theta = mean.received(server.host)
    released = jax.tree.map(lambda t, s: t + s / expected, theta, noised)
    # The host's mean of uploads that all equal the release is the release.
    rows = weights.shape[0]
    state = host.aggregate(server.host, clients,
                           tree.broadcast_to_clients(released, rows), weights)
    clip_norm = extra.clip_norm
    if adaptive:
      assert config.adaptive_clip_quantile is not None
      below = jnp.sum(counted * (uploads.unclipped - 0.5))
      below = below + count_noise * jax.random.normal(count_key, ())
      clip_norm = adapted_clip_norm(clip_norm, below / expected + 0.5,
                                    config.adaptive_clip_quantile, config.clip_learning_rate)
    return state._replace(server=Extended(state.server, DpState(
        key=extra.key, round=extra.round + 1, clip_norm=clip_norm)))

  def artifacts(server: Extended) -> dict[str, jax.Array]:
    return {**host.artifacts(server.host), "dp_clip_norm": server.extra.clip_norm}

  # Outermost: no later plug-in wraps it, so it declares nothing further.
  return extended._replace(broadcast=broadcast, client_update=client_update,
                           aggregate=aggregate, artifacts=artifacts, ala_hooks=None,
                           shared_part=None, upload_mean=None,
                           divergence_hint=divergence_hint)
