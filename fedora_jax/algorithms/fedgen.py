"""FedGen: FedAvg whose server also learns a generator of representations from the
clients' classifier heads, from which every client then learns beside its data.

Zhu, Hong, Zhou. "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning." ICML 2021. https://arxiv.org/abs/2105.10056
(code: PFLlib's servergen.py / clientgen.py, which the verification runs beside this
module; the authors' zhuangdizhu/FedGen, read)

A sampled client trains the global model on CE on its data + CE of its head on generated
representations z = G_w(noise, y'), y' ~ p(y); the server takes server_epochs Adam steps
on the generator G_w against the uploaded heads' ensemble (ensemble "uniform" or "samples"),
then averages the models (FedAvg); every client is scored with the global model.
FedGenConfig: noise_dim 512, hidden_dim 512, generator_lr 0.005, server_epochs 1000.

Departures: none of the authors' extra terms (the paper's two objectives, as PFLlib); a
partial last batch trains (PFLlib drops it).

Details (every option, the departures, measurements): docs/algorithms/fedgen.md.
"""

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.fedlc import class_counts
from fedora_jax.algorithms.fedrep import batch_size_of
from fedora_jax.algorithms.layers import affine_head, check_representation_trainer, head_layer
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import FieldError, check_one_of, traced
from fedora_jax.models.generator import FeatureGenerator, draw_inputs, init_generator

Params = Any
ENSEMBLES = ("uniform", "samples")


class FedGenConfig(NamedTuple):
  noise_dim: int = 512             # the generator's noise (PFLlib's --noise_dim)
  hidden_dim: int = 512            # its hidden layer (PFLlib's --hidden_dim)
  generator_lr: float = 0.005      # its Adam (PFLlib's --generator_learning_rate)
  server_epochs: int = 1000        # its Adam steps a round (PFLlib's --server_epochs)
  ensemble: str = "uniform"        # the heads' weights: uniform (paper) or samples (PFLlib)


FLAG_HELP = {
    "noise_dim": "FedGen: size of the generator's uniform noise",
    "hidden_dim": "FedGen: width of the generator's hidden layer",
    "generator_lr": "FedGen: learning rate of the server's Adam on the generator",
    "server_epochs": "FedGen: the generator's Adam steps each round, each on a fresh"
                     " generated batch",
    "ensemble": "FedGen: the clients' heads weighted alike in the generator's teacher"
                " (uniform, the paper's 1/K) or by training samples (samples, PFLlib)",
}


class GenServer(NamedTuple):
  params: Params              # the global model theta
  generator: Params           # G_w
  opt_state: Any              # the generator's Adam state
  class_weights: jax.Array    # [C] the federation's training samples per class: p(y)
  key: jax.Array              # raw key data of the server's draws
  round: jax.Array            # [] int32


class GenMessage(NamedTuple):
  params: Params
  generator: Params
  class_weights: jax.Array


def validate(config: FedGenConfig, trainer: ClientTrainer) -> FedGenConfig:
  for field in ("noise_dim", "hidden_dim"):
    if getattr(config, field) < 1:
      raise FieldError("fedgen", field, f"must be >= 1, got {getattr(config, field)}")
  if config.server_epochs < 0:
    raise FieldError("fedgen", "server_epochs", f"must be >= 0, got {config.server_epochs}")
  if not traced(config.generator_lr) and not config.generator_lr > 0:
    raise FieldError("fedgen", "generator_lr", f"must be > 0, got {config.generator_lr}")
  check_one_of("fedgen", config, "ensemble", ENSEMBLES)
  check_representation_trainer("fedgen", trainer)
  return config


def generator_for(head: Params, hidden: int) -> FeatureGenerator:
  """The generator into the representation a Dense head [d, C] reads."""
  features, num_classes = head["kernel"].shape
  return FeatureGenerator(features=features, num_classes=num_classes, hidden=hidden)


def generated_loss(head: Params, generator: FeatureGenerator, generator_params: Params,
                   key: jax.Array, class_weights: jax.Array, batch_size: int,
                   noise_dim: int) -> jax.Array:
  """CE(g(z), y') over a generated batch: y' ~ class_weights, z = G(noise, y')."""
  labels, noise = draw_inputs(key, class_weights, batch_size, noise_dim)
  z = cast(jax.Array, generator.apply(generator_params, noise, labels))
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(affine_head(head, z),
                                                                  labels))


def ensemble_weights(weights: jax.Array, ensemble: str) -> jax.Array:
  """[K] a_k over the clients that uploaded (weight > 0), summing to 1."""
  if ensemble == "uniform":
    weights = (weights > 0).astype(jnp.float32)
  return weights / jnp.maximum(jnp.sum(weights), 1e-30)


def train_generator(generator: FeatureGenerator, generator_params: Params, opt_state,
                    optimizer: optax.GradientTransformation, teacher: Params,
                    key: jax.Array, class_weights: jax.Array, steps: int,
                    batch_size: int, noise_dim: int):
  """`steps` optimizer steps on the generator, step t on the batch of fold_in(key, t),
  against the teacher head (fixed); -> (generator_params, opt_state)."""
  def step(carry, t):
    params, state = carry
    grads = jax.grad(lambda p: generated_loss(teacher, generator, p, jax.random.fold_in(key, t),
                                              class_weights, batch_size, noise_dim))(params)
    updates, state = optimizer.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None
  (generator_params, opt_state), _ = jax.lax.scan(step, (generator_params, opt_state),
                                                  jnp.arange(steps))
  return generator_params, opt_state


def fedgen(config: FedGenConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  batch_size = batch_size_of(trainer)
  optimizer = optax.adam(config.generator_lr, b1=0.9, b2=0.999, eps=1e-8)

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    head = first["params"][head_layer(first, "fedgen")]
    generator = generator_for(head, config.hidden_dim)
    generator_key, server_key = jax.random.split(context.key)
    generator_params = init_generator(generator, generator_key, config.noise_dim)
    num_classes = head["kernel"].shape[-1]
    counts = jnp.asarray(sum(class_counts(jnp.asarray(b.train.y), jnp.asarray(b.train.mask),
                                          num_classes) for b in context.data.buckets))
    server = GenServer(params=first, generator=generator_params,
                       opt_state=optimizer.init(generator_params), class_weights=counts,
                       key=raw_key(server_key), round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=jnp.zeros((tree.leading_size(context.params),)))

  def broadcast(server: GenServer, clients):
    message = GenMessage(server.params, server.generator, server.class_weights)
    return tree.broadcast_to_clients(message, tree.leading_size(clients))

  def client_update(client_state, message: GenMessage, data, key):
    head_name = head_layer(message.params, "fedgen")
    generator = generator_for(message.params["params"][head_name], config.hidden_dim)
    train_key, generated_key = jax.random.split(key)
    # Each real step's generated batch from fold_in(generated_key, its index): the carry
    # counts the real steps (a padded step keeps it).
    generator_params = jax.lax.stop_gradient(message.generator)

    def loss(params, step, x, y, weights):
      data_loss = masked_cross_entropy(trainer.apply(params, x), y, weights)
      extra = generated_loss(params["params"][head_name], generator, generator_params,
                             jax.random.fold_in(generated_key, step), message.class_weights,
                             batch_size, config.noise_dim)
      return data_loss + extra, step + 1
    params, stats, _ = trainer.train(message.params, data.train, train_key, loss_fn=loss,
                                     carry=jnp.zeros((), jnp.int32))
    return ClientOutput(state=client_state, upload=params, train=stats)

  def aggregate(server: GenServer, clients, uploads, weights):
    head_name = head_layer(server.params, "fedgen")
    teacher = tree.weighted_mean(uploads["params"][head_name],
                                 ensemble_weights(weights, config.ensemble))
    key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
    generator_params, opt_state = train_generator(
        generator_for(teacher, config.hidden_dim), server.generator, server.opt_state,
        optimizer, teacher, key, server.class_weights, config.server_epochs, batch_size,
        config.noise_dim)
    server = server._replace(params=tree.weighted_mean(uploads, weights),
                             generator=generator_params, opt_state=opt_state,
                             round=server.round + 1)
    return AlgorithmState(server=server, clients=clients)

  def personalized_params(server: GenServer, clients):
    return tree.broadcast_to_clients(server.params, tree.leading_size(clients))

  return Algorithm(name="fedgen", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.params, uploads_unordered=True)
