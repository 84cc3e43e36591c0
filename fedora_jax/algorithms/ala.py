"""Adaptive Local Aggregation (ALA), FedALA's client-side step, as a plug-in for any
algorithm that sends its clients a global model.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning." AAAI 2023. https://arxiv.org/abs/2212.01197
(code: github.com/TsingZ0/FedALA, system/utils/ALA.py; also in TsingZ0/PFLlib)

A sampled client's host training starts from theta_i + (Theta - theta_i) * W_i on the top p
layers and from Theta below them (theta_i its last trained model, Theta the global model),
W_i in [0, 1] learned by SGD on s% of its data: not in its first round, until convergence in
its second, one epoch after. The host's uploads and server are untouched (`with_ala`,
`Algorithm.ala_hooks`). AlaConfig: s 80, p 1, eta 1.0, threshold 0.1, num_pre_loss 10.

Departures: p counts layers, not tensors; a fresh s% sample each round (sample="slice" is
the authors'); the mean epoch loss (epoch_loss="last"); only sampled clients run ALA.

Details (every option, the departures, measurements): docs/algorithms/ala.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, InitContext
from fedora_jax.algorithms.layers import layer_names, merge_layers, take_layers
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import batch_stats
from fedora_jax.engine.local_training import ClientTrainer, epoch_batches
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any
PyTree = Any


class AlaConfig(NamedTuple):
  s: float = 80.0           # percent of the local training data W is learned on (rand_percent)
  p: int = 1                # top layers aggregated element-wise; the rest take the global ones
  eta: float = 1.0          # learning rate of W
  threshold: float = 0.1    # converged when std of the last num_pre_loss epoch losses < this
  num_pre_loss: int = 10    # epoch losses the convergence test looks at
  max_epochs: int = 100     # bound on W's epochs in the converging (second) round
  batch_size: int = 64      # batch size of W's SGD (the run's default --batch_size)
  sample: str = "random"    # W's data: "random" subset, or the authors' contiguous "slice"
  epoch_loss: str = "mean"  # convergence test's epoch loss: "mean" or the authors' "last"


FLAG_HELP = {
    "s": "ALA: percent s of the local training data the aggregation weights W learn on",
    "p": "ALA: number of top layers aggregated element-wise (lower layers take the global"
         " model's)",
    "eta": "ALA: learning rate of the aggregation weights W",
    "threshold": "ALA: W trains until the std of the last num_pre_loss epoch losses is"
                 " below this (second round only)",
    "num_pre_loss": "ALA: epoch losses the convergence test of W looks at",
    "max_epochs": "ALA: at most this many epochs of W in the converging round",
    "batch_size": "ALA: batch size of W's SGD",
    "sample": "ALA: W's data, random (a fresh s% subset, reshuffled each epoch) or slice"
              " (the authors': s% consecutive samples from a random start, in stored order,"
              " the same batches every epoch)",
    "epoch_loss": "ALA: the epoch loss the convergence test reads, mean (of the epoch's"
                  " batch losses) or last (the last batch's, the authors')",
}
SAMPLES = ("random", "slice")
EPOCH_LOSSES = ("mean", "last")


def validate(config: AlaConfig) -> AlaConfig:
  if not 0.0 < config.s <= 100.0:
    raise FieldError("ala", "s", f"must be in (0, 100], got {config.s}")
  if config.p < 1:
    raise FieldError("ala", "p", f"must be >= 1, got {config.p}")
  if not config.eta > 0:
    raise FieldError("ala", "eta", f"must be > 0, got {config.eta}")
  if config.num_pre_loss < 2:
    raise FieldError("ala", "num_pre_loss", f"must be >= 2, got {config.num_pre_loss}")
  if config.max_epochs < 1:
    raise FieldError("ala", "max_epochs", f"must be >= 1, got {config.max_epochs}")
  if config.batch_size < 1:
    raise FieldError("ala", "batch_size", f"must be >= 1, got {config.batch_size}")
  check_one_of("ala", config, "sample", SAMPLES)
  check_one_of("ala", config, "epoch_loss", EPOCH_LOSSES)
  return config


class AlaClient(NamedTuple):
  host: PyTree       # the host's own client state, leaves [K, ...]
  local: Params      # [K, ...] theta_i: the model each client ended its last round with
  weights: Params    # [K, ...] W_i over the top p layers only ({"params": {top layers}})
  rounds: jax.Array  # [K] int32 rounds the client has completed


def top_layers(params: Params, p: int) -> list[str]:
  """The top p layers of `params`, the model (or the layers of it) the host sends."""
  names = layer_names(params)
  if p > len(names):
    raise FieldError("ala", "p", f"must be at most the {len(names)} layers the host sends"
                                 f" its clients, got {p}")
  return names[len(names) - p:]


def overwrite(host_state: PyTree, local: Params, theta_hat: Params, key: jax.Array) -> Params:
  """The default AlaHooks.initial: theta_i with the received layers taken from theta_hat."""
  del host_state, key
  return merge_layers(local, theta_hat)


def aggregate_locally(local: Params, global_params: Params, weights: Params) -> Params:
  """theta_hat: global lower layers; local + (global - local) * W on the layers in W;
  every BatchNorm running average the local model's (the authors' ALA sets parameters
  only, and PyTorch keeps running averages as buffers: W's entries at them are unused)."""
  top = jax.tree.map(lambda l, g, w: l + (g - l) * w,
                     take_layers(local, list(weights["params"])),
                     take_layers(global_params, list(weights["params"])), weights)
  theta_hat = merge_layers(global_params, top)
  return batch_stats.take_statistics(theta_hat,
                                     take_layers(local, list(theta_hat["params"])))


def _epoch_limit(rounds: jax.Array, config: AlaConfig) -> jax.Array:
  """W's epochs this round: 0 in the first, up to max_epochs in the second, then 1."""
  return jnp.where(rounds == 0, 0, jnp.where(rounds == 1, config.max_epochs, 1))


def sample_size(s: float, n) -> jax.Array:
  """m = floor(s% of n), at least 1: the samples W learns on."""
  return jnp.maximum(1, jnp.floor(s / 100.0 * n)).astype(jnp.int32)


def slice_start(key: jax.Array, n, m) -> jax.Array:
  """The first of the slice's m consecutive samples, uniform in [0, n - m] (the authors'
  random.randint(0, n - m))."""
  return jax.random.randint(key, (), 0, n - m + 1)


def slice_batches(key: jax.Array, n, m, batch_size: int, num_batches: int
                  ) -> tuple[jax.Array, jax.Array]:
  """The authors' sample: m consecutive samples from slice_start, in stored order, cut
  into [num_batches, B] indices and weights (1 real, 0 pad), the last batch partial."""
  slots = jnp.arange(num_batches * batch_size)
  idx = jnp.where(slots < m, slice_start(key, n, m) + slots, 0)
  return (idx.reshape(num_batches, batch_size),
          (slots < m).astype(jnp.float32).reshape(num_batches, batch_size))


def learn_weights(loss_fn, config: AlaConfig, local: Params, global_params: Params,
                  weights: Params, rounds: jax.Array, data: ClientData, key: jax.Array):
  """ALA's weight learning for ONE client: returns (W, epochs trained, last epoch loss;
  0 when W did not train this round)."""
  size = data.mask.shape[0]
  sample_key, epochs_key = jax.random.split(key)
  m = sample_size(config.s, data.n)
  # A random s% of the real samples: the m lowest random ranks, padding ranked last.
  ranks = jnp.where(data.mask, jax.random.uniform(sample_key, (size,)), 2.0)
  position = jnp.argsort(jnp.argsort(ranks))
  subset = data.mask & (position < m)
  max_subset = max(1, int(config.s / 100.0 * size))
  num_batches = -(-max_subset // config.batch_size)
  if config.sample == "slice":  # the authors' slice, its batches the same every epoch
    sliced = slice_batches(sample_key, data.n, m, config.batch_size, num_batches)

  def batch_loss(w, idx, batch_weights):
    return loss_fn(aggregate_locally(local, global_params, w), data.x[idx], data.y[idx],
                   batch_weights)

  def w_step(w, batch):
    idx, batch_weights = batch
    # BatchNorm in train mode, as the authors' temporary model runs after local training;
    # the new running averages those passes return are not kept (theta_hat's are the
    # local model's, whatever W is).
    with batch_stats.training(batch_weights > 0):
      loss, grad = jax.value_and_grad(batch_loss)(w, idx, batch_weights)
    stepped = jax.tree.map(lambda a, g: jnp.clip(a - config.eta * g, 0.0, 1.0), w, grad)
    real = jnp.sum(batch_weights) > 0
    w = jax.tree.map(lambda a, b: jnp.where(real, a, b), stepped, w)
    return w, (loss * real, real)

  def epoch(carry):
    w, count, losses = carry
    if config.sample == "slice":
      idx, batch_weights = sliced
    else:
      idx, batch_weights = epoch_batches(jax.random.fold_in(epochs_key, count), subset, m,
                                         config.batch_size, num_batches)
    w, (batch_losses, real) = jax.lax.scan(w_step, w, (idx, batch_weights))
    if config.epoch_loss == "last":  # real batches come first
      epoch_loss = batch_losses[jnp.maximum(jnp.sum(real.astype(jnp.int32)) - 1, 0)]
    else:
      epoch_loss = jnp.sum(batch_losses) / jnp.maximum(jnp.sum(real), 1)
    losses = losses.at[count % config.num_pre_loss].set(epoch_loss)
    return w, count + 1, losses

  limit = _epoch_limit(rounds, config)

  def keep_going(carry):
    _, count, losses = carry
    converged = (count > config.num_pre_loss) & (jnp.std(losses) < config.threshold)
    return (count < limit) & ~converged

  losses = jnp.zeros((config.num_pre_loss,), jnp.float32)
  weights, count, losses = jax.lax.while_loop(
      keep_going, epoch, (weights, jnp.zeros((), jnp.int32), losses))
  last = losses[(count - 1) % config.num_pre_loss]
  return weights, count, jnp.where(count > 0, last, 0.0)  # 0: W did not train this round


def _host_state_upload(read):
  """The host's `state_upload` of the host's state inside ALA's client state."""
  return None if read is None else (lambda client: read(client.host))


def with_ala(host: Algorithm, config: AlaConfig, trainer: ClientTrainer,
             name: str | None = None) -> Algorithm:
  """The host algorithm with ALA's local initialization in front of its client update,
  where its `ala_hooks` say."""
  config = validate(config)
  hooks = host.ala_hooks
  if hooks is None:
    raise ConfigError(f"--ala needs an algorithm that sends a global model; {host.name}"
                      " declares none (Algorithm.ala_hooks)")

  initial = hooks.initial or overwrite

  def init(context: InitContext) -> AlgorithmState:
    state = host.init(context)
    # W covers the top p layers of the model the host sends (its layers, no computation).
    received = jax.eval_shape(lambda: hooks.received(host.broadcast(state.server,
                                                                    state.clients)))
    weights = jax.tree.map(jnp.ones_like,
                           take_layers(context.params, top_layers(received, config.p)))
    num_clients = tree.leading_size(context.params)
    return AlgorithmState(server=state.server, clients=AlaClient(
        host=state.clients, local=context.params, weights=weights,
        rounds=jnp.zeros((num_clients,), jnp.int32)))

  def broadcast(server, clients: AlaClient):
    return host.broadcast(server, clients.host)

  def client_update(client: AlaClient, message, data, key):
    ala_key, host_key = jax.random.split(key)
    global_params = hooks.received(message)

    def initial_loss(theta_hat, x, y, batch_weights):  # the loss of the model trained from
      return trainer.loss(initial(client.host, client.local, theta_hat, host_key), x, y,
                          batch_weights)
    weights, epochs, loss = learn_weights(initial_loss, config, client.local, global_params,
                                          client.weights, client.rounds, data.train, ala_key)
    theta_hat = aggregate_locally(client.local, global_params, weights)
    # The first round's theta_i is the initial model: start from the global one exactly.
    theta_hat = jax.tree.map(lambda a, g: jnp.where(client.rounds == 0, g, a), theta_hat,
                             global_params)
    host_state, message = hooks.replace(client.host, message, theta_hat)
    out = host.client_update(host_state, message, data, host_key)
    weight_sum = sum(jnp.sum(w) for w in jax.tree.leaves(weights))
    weight_count = sum(w.size for w in jax.tree.leaves(weights))
    state = AlaClient(host=out.state, local=hooks.trained(out), weights=weights,
                      rounds=client.rounds + 1)
    return out._replace(state=state, metrics={
        **out.metrics, "ala_epochs": epochs, "ala_loss": loss,
        "ala_weight_mean": weight_sum / weight_count})

  def aggregate(server, clients: AlaClient, uploads, weights):
    state = host.aggregate(server, clients.host, uploads, weights)
    return AlgorithmState(server=state.server, clients=clients._replace(host=state.clients))

  def personalized_params(server, clients: AlaClient):
    if hooks.personal_is_local:
      return clients.local
    return host.personalized_params(server, clients.host)

  return Algorithm(name=name or f"{host.name}+ala", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params, artifacts=host.artifacts,
                   # The host's own evaluation of its personalized model (APFL's output
                   # mixture), unless ALA evaluates theta_i, a model of the run.
                   evaluate=None if hooks.personal_is_local else host.evaluate,
                   # The server's state and uploads are the host's: its ConFREE and DP
                   # parts too.
                   shared_part=host.shared_part, upload_mean=host.upload_mean,
                   trains_unsampled=host.trains_unsampled,
                   state_upload=_host_state_upload(host.state_upload))
