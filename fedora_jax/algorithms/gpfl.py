"""GPFL: a conditional valve (CoV) after the shared feature extractor opens a generic route,
guided by global category embeddings (GCE), and a personalised route into the client's
own head.

Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan. "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning." ICCV 2023.
https://arxiv.org/abs/2308.10279
(code: github.com/TsingZ0/GPFL, clientgp.py / servergp.py / run_me.sh; the same code is
PFLlib's clientgpfl.py / servergpfl.py, which the verification runs beside this module.
The paper's full text is not on disk: this module follows that code, and names no
equation numbers.)

Each round a sampled client trains the extractor phi, its head, the GCE and the CoV on CE +
the GCE's angle loss + lam (0.01) ||CoV(z, g_i) - E[y]|| + weight decay mu (0.1) on the GCE and
CoV; the server averages phi, the GCE and the CoV. Scored: h_i(CoV(phi(x), p_i)).

Departures: the run's optimizer trains every part; alpha_i counts every sample; a partial
last batch trains.
Details (every option, the departures, measurements): docs/algorithms/gpfl.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import (affine_head, apply_with_representation,
                                          check_representation_trainer, head_layer,
                                          merge_layers, split_body_head, take_layers)
from fedora_jax.engine.buckets import map_over_buckets
from fedora_jax.engine.local_training import ClientTrainer, masked_cross_entropy
from fedora_jax.errors import ConfigError, FieldError

Params = Any
LAYER_NORM_EPS = 1e-5   # PyTorch's nn.LayerNorm default
NORMALIZE_EPS = 1e-12   # F.normalize's


class GpflConfig(NamedTuple):
  lam: float = 0.01  # weight of ||CoV(z, g) - E_frozen[y]|| (run_me.sh: CNN and MLP)
  mu: float = 0.1    # weight decay of the GCE and the CoV (run_me.sh: CNN and MLP)


FLAG_HELP = {
    "lam": "GPFL: weight lambda of the distance between the generic features and the"
           " received category embeddings of their labels (the authors' 0.01 for CNNs and"
           " MLPs, 1e-4 for ResNet-18)",
    "mu": "GPFL: weight decay mu of the category embeddings and the conditional valve"
          " (the authors' 0.1 for CNNs and MLPs, 0 for ResNet-18)",
}


class GpflServer(NamedTuple):
  body: Params            # phi
  embeddings: jax.Array   # [C, d] the GCE
  valve: Params           # the CoV: {"gamma": branch, "beta": branch}


class GpflClient(NamedTuple):
  head: Params            # [K, ...] {"params": {head: ...}} h_i
  class_shares: jax.Array     # [K, C] alpha_i
  generic_input: jax.Array    # [K, d] g_i
  personal_input: jax.Array   # [K, d] p_i


class GpflModel(NamedTuple):
  """One client's scored model: h_i(CoV(phi(x), p_i))."""
  model: Params           # phi under h_i: the run's model
  valve: Params
  personal_input: jax.Array   # [d]


class GpflTrained(NamedTuple):
  model: Params
  embeddings: jax.Array
  valve: Params


def validate(config: GpflConfig, trainer: ClientTrainer) -> GpflConfig:
  if config.lam < 0:
    raise FieldError("gpfl", "lam", f"must be >= 0, got {config.lam}")
  if config.mu < 0:
    raise FieldError("gpfl", "mu", f"must be >= 0, got {config.mu}")
  check_representation_trainer("gpfl", trainer)
  if trainer.evaluate_with is None:
    raise ConfigError("gpfl needs the trainer's evaluate_with (make_client_trainer)")
  return config


def init_branch(key: jax.Array, dim: int) -> Params:
  """Linear(d, d) with PyTorch's U(+-1/sqrt(d)), then LayerNorm(d) at scale 1, offset 0."""
  bound = 1.0 / jnp.sqrt(dim)
  kernel_key, bias_key = jax.random.split(key)
  return {"kernel": jax.random.uniform(kernel_key, (dim, dim), jnp.float32, -bound, bound),
          "bias": jax.random.uniform(bias_key, (dim,), jnp.float32, -bound, bound),
          "scale": jnp.ones((dim,), jnp.float32), "offset": jnp.zeros((dim,), jnp.float32)}


def conditional_branch(branch: Params, context: jax.Array) -> jax.Array:
  """[d] LayerNorm(ReLU(c W + b))."""
  hidden = jax.nn.relu(context @ branch["kernel"] + branch["bias"])
  centred = hidden - jnp.mean(hidden)
  normed = centred / jnp.sqrt(jnp.mean(jnp.square(centred)) + LAYER_NORM_EPS)
  return normed * branch["scale"] + branch["offset"]


def valve(valve_params: Params, features: jax.Array, context: jax.Array) -> jax.Array:
  """[B, d] CoV(z, c) = ReLU(z * (gamma(c) + 1) + beta(c))."""
  gamma = conditional_branch(valve_params["gamma"], context)
  beta = conditional_branch(valve_params["beta"], context)
  return jax.nn.relu(features * (gamma + 1.0) + beta)


def _normalize(v: jax.Array) -> jax.Array:
  return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), NORMALIZE_EPS)


def embedding_loss(embeddings: jax.Array, features: jax.Array, y: jax.Array,
                   weights: jax.Array) -> jax.Array:
  """The GCE's loss: cross-entropy of the cosines between features and embeddings."""
  cosines = _normalize(features) @ _normalize(embeddings).T
  return masked_cross_entropy(cosines, y, weights)


def anchor_distance(features: jax.Array, anchors: jax.Array, weights: jax.Array) -> jax.Array:
  """||features - anchors||_2 over the batch's real rows (the code's torch.norm), with a
  zero gradient at zero distance."""
  squared = jnp.sum(weights[:, None] * jnp.square(features - anchors))
  positive = squared > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def conditional_inputs(embeddings: jax.Array, shares: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(g, p) = (the mean embedding, the embeddings weighted by the class shares)."""
  return jnp.mean(embeddings, axis=0), shares @ embeddings


def squared_norm(params: Params) -> jax.Array:
  return jnp.asarray(sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(params)))


def gpfl(config: GpflConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply, evaluate_with = trainer.apply, trainer.evaluate_with
  assert apply is not None and evaluate_with is not None  # validate() checked them

  def parts(params: Params) -> tuple[list[str], str]:
    head = head_layer(params, "gpfl")
    return split_body_head(params, 1, "gpfl")[0], head

  def features_of(params: Params, head: str, x: jax.Array) -> jax.Array:
    return apply_with_representation(apply, params, x, head)[1]

  def init(context: InitContext) -> AlgorithmState:
    first = tree.first(context.params)
    body_names, head = parts(first)
    dim, num_classes = first["params"][head]["kernel"].shape
    num_clients = tree.leading_size(context.params)
    embedding_key, gamma_key, beta_key = jax.random.split(context.key, 3)
    server = GpflServer(
        body=take_layers(first, body_names),
        embeddings=jax.random.normal(embedding_key, (num_classes, dim), jnp.float32),
        valve={"gamma": init_branch(gamma_key, dim), "beta": init_branch(beta_key, dim)})

    def shares_of(splits):
      counts = jnp.sum(jax.nn.one_hot(splits.train.y, num_classes)
                       * splits.train.mask[:, None], axis=0)
      return counts / jnp.maximum(jnp.sum(counts), 1.0)
    data = context.data
    shares = map_over_buckets(shares_of, (), data.buckets, data.client_ids, num_clients)
    zeros = jnp.zeros((num_clients, dim), jnp.float32)
    clients = GpflClient(head=take_layers(context.params, [head]), class_shares=shares,
                         generic_input=zeros, personal_input=zeros)
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: GpflServer, clients: GpflClient):
    return tree.broadcast_to_clients(server, clients.class_shares.shape[0])

  def client_update(client: GpflClient, server: GpflServer, data, key):
    model = merge_layers(server.body, client.head)
    body_names, head = parts(model)
    frozen = server.embeddings   # E_frozen: the GCE received, a constant of the loss

    def loss(p: GpflTrained, x, y, weights):
      features = features_of(p.model, head, x)
      personal = affine_head(p.model["params"][head],
                             valve(p.valve, features, client.personal_input))
      generic = valve(p.valve, features, client.generic_input)
      return (masked_cross_entropy(personal, y, weights)
              + embedding_loss(p.embeddings, generic, y, weights)
              + config.lam * anchor_distance(generic, frozen[y], weights))

    def weight_decay(p: GpflTrained) -> jax.Array:
      return 0.5 * config.mu * (squared_norm(p.embeddings) + squared_norm(p.valve))

    start = GpflTrained(model=model, embeddings=server.embeddings, valve=server.valve)
    trained, stats = trainer.train(start, data.train, key, loss_fn=loss,
                                   regularizer=weight_decay)
    upload = GpflServer(body=take_layers(trained.model, body_names),
                        embeddings=trained.embeddings, valve=trained.valve)
    return ClientOutput(state=client._replace(head=take_layers(trained.model, [head])),
                        upload=upload, train=stats)

  def aggregate(server: GpflServer, clients: GpflClient, uploads: GpflServer, weights):
    new_server = tree.weighted_mean(uploads, weights)
    sampled = weights > 0
    # The GCE each client holds before it receives the new one (set_GCE).
    held = jnp.where(sampled[:, None, None], uploads.embeddings, server.embeddings)
    generic, personal = jax.vmap(conditional_inputs)(held, clients.class_shares)
    return AlgorithmState(server=new_server, clients=clients._replace(
        generic_input=generic, personal_input=personal))

  def personalized_params(server: GpflServer, clients: GpflClient) -> GpflModel:
    num_clients = clients.class_shares.shape[0]
    bodies = tree.broadcast_to_clients(server.body, num_clients)
    return GpflModel(model=merge_layers(bodies, clients.head),
                     valve=tree.broadcast_to_clients(server.valve, num_clients),
                     personal_input=clients.personal_input)

  def forward(model: GpflModel, x: jax.Array) -> jax.Array:
    head = head_layer(model.model, "gpfl")
    features = features_of(model.model, head, x)
    return affine_head(model.model["params"][head],
                       valve(model.valve, features, model.personal_input))

  return Algorithm(name="gpfl", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   evaluate=evaluate_with(forward))
