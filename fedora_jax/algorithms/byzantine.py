"""Byzantine clients: a fraction of the clients upload malicious updates, as a plug-in on
any algorithm whose server aggregates a shared part (--attackers=FRACTION --attack=...).

Baruch, Baruch, Goldberg. NeurIPS 2019 (alie). Xie, Koyejo, Gupta. UAI 2020 (ipm).

Each round every attacker among the uploaders sends theta + b_i in place of its trained
theta + g_i, b_i from the round's honest updates (an omniscient attacker): sign_flip -g_i;
gaussian N(0, std^2 I); alie mu_H - z sigma_H; ipm -epsilon mu_H; label_flip uploads what
training on labels C - 1 - y gives. AttackConfig: attack "sign_flip", fraction 0.2
(round(fraction K) clients, one set from the run's seed; sampled: drawn each round),
std 1.0, epsilon 0.5, z -1 (from n and f). Only the shared part is poisoned; the plug-in goes
outermost, so a robust aggregator (robust.py) or ConFREE sees the poisoned uploads.

Departures: alie takes the sign that opposes the mean (blades' AlieClient), where the
paper's Algorithm 3 moves every coordinate by z sigma.

Details (every option, the departures, measurements): docs/algorithms/byzantine.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm

from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.extended_server import Extended, lift_shared_part
from fedora_jax.errors import ConfigError, FieldError

PyTree = Any
ATTACKS = ("sign_flip", "gaussian", "alie", "ipm", "label_flip")
_KEY_TAG = 0x42797A  # the attackers' stream from the algorithm's init key
_TINY = 1e-12


class AttackConfig(NamedTuple):
  attack: str = "sign_flip"
  fraction: float = 0.2      # attackers: round(fraction K) clients
  sampled: bool = False      # drawn anew each round (else one set for the run)
  std: float = 1.0           # gaussian: the malicious update's standard deviation
  epsilon: float = 0.5       # ipm: b = -epsilon mu_H
  z: float = -1.0            # alie: deviations from the mean; -1: from n and f (paper)


# Flags --attack_<field>; attack, fraction and sampled are --attack, --attackers and
# --attackers_sampled.
FLAG_HELP = {
    "std": "gaussian attack: the standard deviation of the malicious update",
    "epsilon": "ipm attack: the malicious update is -epsilon times the honest mean (Xie"
               " et al. 2020)",
    "z": "alie attack: the standard deviations the malicious update sits from the honest"
         " mean; -1: z from the round's n and f (Baruch et al. 2019)",
}


class AttackServer(NamedTuple):
  key: jax.Array     # key data of the attackers' stream
  round: jax.Array   # [] int32, rounds aggregated so far


class AttackClient(NamedTuple):
  host: PyTree
  attacker: jax.Array      # [] bool (stacked [K]): this client attacks in this round
  num_classes: jax.Array   # [] int32: C, for label_flip


def validate(config: AttackConfig) -> AttackConfig:
  if config.attack not in ATTACKS:
    raise FieldError("attack", "attack", f"must be one of {', '.join(ATTACKS)}, got"
                                         f" {config.attack!r}")
  if not 0.0 <= config.fraction < 1.0:
    raise FieldError("attack", "fraction", f"must be in [0, 1), got {config.fraction}")
  if config.std < 0:
    raise FieldError("attack", "std", f"must be >= 0, got {config.std}")
  if config.epsilon < 0:
    raise FieldError("attack", "epsilon", f"must be >= 0, got {config.epsilon}")
  if config.z != -1.0 and config.z < 0:
    raise FieldError("attack", "z", f"must be >= 0 or -1, got {config.z}")
  return config


def num_attackers(fraction: float, num_clients: int) -> int:
  return int(round(fraction * num_clients))


def choose_attackers(key: jax.Array, num_clients: int, count: int) -> jax.Array:
  """[K] bool: `count` clients drawn without replacement."""
  order = jax.random.permutation(key, num_clients)
  return jnp.zeros(num_clients, bool).at[order[:count]].set(True)


def attackers_of_round(config: AttackConfig, key_data: jax.Array, round_: jax.Array,
                       num_clients: int) -> jax.Array:
  """[K] bool: round `round_`'s attackers (the fixed set: round 0's)."""
  key = jax.random.wrap_key_data(key_data)
  round_ = round_ if config.sampled else jnp.zeros_like(round_)
  return choose_attackers(jax.random.fold_in(key, round_), num_clients,
                          num_attackers(config.fraction, num_clients))


def alie_z(num_uploads: jax.Array, num_malicious: jax.Array) -> jax.Array:
  """Baruch et al.'s z_max: Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f."""
  n = jnp.maximum(num_uploads, 1).astype(jnp.float32)
  supporters = jnp.floor(n / 2 + 1) - num_malicious
  return norm.ppf(jnp.clip((n - supporters) / n, 1e-6, 1 - 1e-6))


def honest_moments(updates: PyTree, honest: jax.Array):
  """The honest updates' coordinate-wise mean and sample standard deviation (no client
  axis); zeros where there are too few to say."""
  count = jnp.sum(honest)
  share = jnp.where(honest, 1.0, 0.0) / jnp.maximum(count, 1)

  def moments(leaf):
    mean = jnp.tensordot(share, leaf, axes=(0, 0))
    squares = jnp.tensordot(jnp.where(honest, 1.0, 0.0), jnp.square(leaf - mean[None]),
                            axes=(0, 0))
    return mean, jnp.sqrt(squares / jnp.maximum(count - 1, 1))
  pairs = jax.tree.map(moments, updates)
  is_pair = lambda node: isinstance(node, tuple) and len(node) == 2
  return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
          jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))


def malicious_updates(config: AttackConfig, updates: PyTree, uploaded: jax.Array,
                      attacker: jax.Array, key: jax.Array) -> PyTree:
  """[K, ...]: every client's update as it uploads it: the attackers' b_i in place of
  their g_i (the others' unchanged; label_flip: everyone's unchanged)."""
  malicious = attacker & uploaded
  honest = uploaded & ~attacker
  attack = config.attack
  if attack == "label_flip":
    return updates
  if attack == "sign_flip":
    bad = jax.tree.map(jnp.negative, updates)
  elif attack == "gaussian":
    leaves, treedef = jax.tree.flatten(updates)
    keys = jax.random.split(key, len(leaves))
    bad = jax.tree.unflatten(treedef, [config.std * jax.random.normal(k, leaf.shape,
                                                                      leaf.dtype)
                                       for k, leaf in zip(keys, leaves)])
  else:
    mean, std = honest_moments(updates, honest)
    if attack == "ipm":
      one = jax.tree.map(lambda m: -config.epsilon * m, mean)
    else:
      z = alie_z(jnp.sum(uploaded), jnp.sum(malicious)) if config.z == -1.0 else config.z
      one = jax.tree.map(lambda m, s: m - z * s, mean, std)
    bad = jax.tree.map(lambda m, g: jnp.broadcast_to(m, g.shape), one, updates)
  return jax.tree.map(lambda b, g: jnp.where(
      malicious.reshape((-1,) + (1,) * (g.ndim - 1)), b, g), bad, updates)


def flip_labels(data, attacker: jax.Array, num_classes: jax.Array):
  """The client's splits with its training labels y -> C - 1 - y where it attacks."""
  train = data.train
  flipped = jnp.where(attacker, num_classes - 1 - train.y, train.y).astype(train.y.dtype)
  return data._replace(train=train._replace(y=flipped))


def with_attackers(host: Algorithm, config: AttackConfig, name: str | None = None) -> Algorithm:
  """The host with round(fraction K) of its clients attacking its shared part."""
  config = validate(config)
  shared = host.shared_part
  if shared is None or shared.replace_uploads is None:
    raise ConfigError(f"--attack={config.attack} needs an algorithm whose server averages a"
                      f" shared part its clients upload; {host.name} declares none"
                      " (Algorithm.shared_part)")
  replace_uploads = shared.replace_uploads

  def init(context: InitContext) -> AlgorithmState:
    state = host.init(context)
    if config.attack == "label_flip" and context.data.task != "classification":
      raise ConfigError(f"--attack=label_flip flips class labels; this data is a"
                        f" {context.data.task}")
    key_data = jax.random.key_data(jax.random.fold_in(context.key, _KEY_TAG))
    num_clients = context.data.num_clients
    round_ = jnp.zeros((), jnp.int32)
    clients = AttackClient(
        host=state.clients,
        attacker=attackers_of_round(config, key_data, round_, num_clients),
        num_classes=jnp.full((num_clients,), context.data.num_classes, jnp.int32))
    return AlgorithmState(server=Extended(state.server, AttackServer(key_data, round_)),
                          clients=clients)

  def client_update(client: AttackClient, message, data, key) -> ClientOutput:
    if config.attack == "label_flip":
      data = flip_labels(data, client.attacker, client.num_classes)
    out = host.client_update(client.host, message, data, key)
    return out._replace(state=client._replace(host=out.state),
                        metrics={**out.metrics, "attacker": client.attacker.astype(
                            jnp.float32)})

  def aggregate(server: Extended, clients: AttackClient, uploads, weights) -> AlgorithmState:
    extra: AttackServer = server.extra
    uploaded = weights > 0
    theta, mine = shared.of_server(server.host), shared.of_uploads(uploads)
    updates = jax.tree.map(lambda upload, g: upload - g[None], mine, theta)
    key = jax.random.fold_in(jax.random.wrap_key_data(extra.key), extra.round)
    sent = malicious_updates(config, updates, uploaded, clients.attacker, key)
    poisoned = jax.tree.map(lambda u, g, t: jnp.where(
        (clients.attacker & uploaded).reshape((-1,) + (1,) * (u.ndim - 1)),
        t[None] + g, u), mine, sent, theta)
    state = host.aggregate(server.host, clients.host,
                           replace_uploads(uploads, poisoned), weights)
    next_round = extra.round + 1
    attackers = attackers_of_round(config, extra.key, next_round, clients.attacker.shape[0])
    return AlgorithmState(
        server=Extended(state.server, extra._replace(round=next_round)),
        clients=clients._replace(host=state.clients, attacker=attackers))

  shared_model, state_upload = host.shared_model, host.state_upload
  sampled_broadcast = host.sampled_broadcast
  return host._replace(
      name=name or f"{host.name}+{config.attack}", init=init,
      sampled_broadcast=(None if sampled_broadcast is None else
                         lambda server, clients, sampled: sampled_broadcast(
                             server.host, clients.host, sampled)),
      state_upload=(None if state_upload is None else
                    lambda client: state_upload(client.host)),
      broadcast=lambda server, clients: host.broadcast(server.host, clients.host),
      client_update=client_update, aggregate=aggregate,
      personalized_params=lambda server, clients: host.personalized_params(server.host,
                                                                           clients.host),
      artifacts=lambda server: host.artifacts(server.host),
      shared_model=(None if shared_model is None else
                    lambda server: shared_model(server.host)),
      # The server reads each client's role, in client order.
      uploads_unordered=False,
      ala_hooks=None,  # ALA goes inside (algorithms.build), on the host's own state
      shared_part=lift_shared_part(shared))
