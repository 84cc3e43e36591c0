"""Floco: FedAvg over a solution simplex of classifiers; each client is given a point of
the simplex from its update signal and trains and predicts around it.

Grinwald, Wiesner, Nakajima. "Federated Learning over Connected Modes." NeurIPS 2024.
https://openreview.net/forum?id=JL2eMCfDW8
(code followed: the authors' Flower baseline, github.com/adap/flower baselines/floco
(floco/strategy.py, model.py, conf/), and their FL-bench fork dennis-grinwald/floco
src/server/floco.py, the same as FL-bench's src/server/floco.py; read through the search
tools, not run or copied. The paper's full text is not on disk, so this module names no
equation numbers. PFLlib has no Floco, so there is no verification row: the unit tests
check the simplex projection, the energy, the PCA and the sampling by hand and numpy.)

The classifier becomes a simplex of `endpoints` (10) kernels; each local step trains at a random
point, and the server averages all (FedAvg). After round `tau` (0.5: half the run) PCA of `signal`
("update") gives client k a centre beta_k, its steps then within `rho` (0.3); it is scored there.

Departures: the signal is a client's update of its last round (the codes train all once more).

Details (every option, the departures, measurements): docs/algorithms/floco.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import linalg, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import head_layer
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import FieldError, check_one_of

Params = Any
SIGNALS = ("update", "params")
ENERGY_GRID = 1000   # the codes' linspace(1e-4, 1, 1000) of simplex scales z
MIN_DISTANCE = 1e-4  # the codes' clamp of the Riesz energy's distances
RANK_RTOL = 1e-5     # PCA eigenvalues below this fraction of the largest count as 0


class FlocoConfig(NamedTuple):
  endpoints: int = 10      # M, the simplex's vertices (the authors' conf, FL-bench's)
  tau: float = 0.5         # the projection round: a fraction of `rounds`, or a count > 1
  rho: float = 0.3         # the radius of a client's L1 ball (authors' conf; FL-bench 0.1)
  signal: str = "update"   # "update": received - trained kernels; "params": trained
  rounds: int = 100        # the run's rounds (a train field)


FLAG_HELP = {
    "endpoints": "Floco: M, the number of classifier kernels spanning the solution simplex",
    "tau": "Floco: the round whose updates place the clients on the simplex, a fraction of"
           " the rounds in (0, 1] or a round count > 1 (the authors' 250 of 500)",
    "rho": "Floco: the L1 radius around a client's point from which its steps sample",
    "signal": "Floco: what PCA reads of each client, its kernels' 'update' (received -"
              " trained, the authors') or its trained 'params' (FL-bench)",
}


class FlocoModel(NamedTuple):
  model: Params        # the run's model; its head's kernel unused (the simplex's instead)
  endpoints: jax.Array  # [M, d, C] W_1..W_M


class FlocoServer(NamedTuple):
  model: FlocoModel
  round: jax.Array      # [] int32, rounds aggregated so far


class FlocoClient(NamedTuple):
  signal: jax.Array     # [M d C] its last update signal
  center: jax.Array     # [M] beta_k (1/M before the projection)


def tau_rounds(config: FlocoConfig) -> int:
  """The projection round: int(tau * rounds) for tau in (0, 1], else int(tau) (< rounds)."""
  if config.rounds < 1:
    raise FieldError("floco", "rounds", f"must be >= 1, got {config.rounds}")
  count = int(config.tau * config.rounds) if 0 < config.tau <= 1 else int(config.tau)
  if not (0 < config.tau <= 1 or 1 < config.tau <= config.rounds) or count < 1:
    raise FieldError("floco", "tau", f"must give a round in 1..{config.rounds}, got"
                     f" {config.tau}")
  return count


def validate(config: FlocoConfig) -> FlocoConfig:
  if not config.endpoints >= 1:
    raise FieldError("floco", "endpoints", f"must be >= 1, got {config.endpoints}")
  if not config.rho >= 0:
    raise FieldError("floco", "rho", f"must be >= 0, got {config.rho}")
  check_one_of("floco", config, "signal", SIGNALS)
  tau_rounds(config)
  return config


def with_kernel(model: Params, head: str, kernel: jax.Array) -> Params:
  """The run's model with its classifier's kernel set to `kernel`."""
  params = dict(model["params"])
  params[head] = {**params[head], "kernel": kernel}
  return {**model, "params": params}


def project_simplex(v: jax.Array, z: jax.Array) -> jax.Array:
  """Rows of v [N, M] projected onto {y >= 0, sum y = z} (the sort-based projection)."""
  u = -jnp.sort(-v, axis=1)
  cssv = jnp.cumsum(u, axis=1) - z
  ind = jnp.arange(1, v.shape[1] + 1, dtype=v.dtype)
  count = jnp.sum(u - cssv / ind > 0, axis=1)
  theta = jnp.take_along_axis(cssv, (count - 1)[:, None], axis=1) / count[:, None]
  return jnp.maximum(v - theta, 0.0)


def riesz_terms(points: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The Riesz s-energy (s = 2) of the rows as (c, rest): sum over pairs i < j of
  1 / max(||p_i - p_j||, 1e-4)^2 = c 1e8 + rest, c the pairs closer than 1e-4 (kept
  apart so that float32 still orders energies that differ below 1e8's precision)."""
  n = points.shape[0]
  diff = points[:, None, :] - points[None, :, :]
  distance = jnp.sqrt(jnp.sum(jnp.square(diff), axis=-1))
  upper = jnp.triu(jnp.ones((n, n), bool), 1)
  close = upper & (distance < MIN_DISTANCE)
  far = upper & ~close
  rest = jnp.sum(jnp.where(far, 1.0 / jnp.square(jnp.where(far, distance, 1.0)), 0.0))
  return jnp.sum(close).astype(points.dtype), rest


def log_riesz_energy(points: jax.Array) -> jax.Array:
  """log of the mean over pairs i < j of 1 / max(||p_i - p_j||, 1e-4)^2."""
  n = points.shape[0]
  close, rest = riesz_terms(points)
  return jnp.log(close / MIN_DISTANCE**2 + rest) - jnp.log(n * (n - 1) / 2)


def pca_scores(signals: jax.Array, components: int) -> jax.Array:
  """[N, components] PCA scores of the rows (centred), each component's largest loading
  positive (scikit-learn's sign); components beyond the rank are 0."""
  centred = signals - jnp.mean(signals, axis=0)
  values, vectors = linalg.eigh(centred @ centred.T)   # ascending
  order = jnp.arange(signals.shape[0] - 1, -1, -1)[:components]
  values, vectors = values[order], vectors[:, order]
  # Components past the rank: float32 leaves eigenvalues of noise there, whose scores
  # would differ from one program to the next; they are 0 (RANK_RTOL of the largest).
  values = jnp.where(values > RANK_RTOL * values[0], values, 0.0)
  scores = vectors * jnp.sqrt(values)                   # U S
  loadings = centred.T @ vectors                        # V S: the sign of V's columns
  biggest = jnp.take_along_axis(loadings, jnp.argmax(jnp.abs(loadings), axis=0)[None], 0)
  scores = scores * jnp.where(biggest[0] < 0, -1.0, 1.0)
  pad = components - scores.shape[1]
  return jnp.pad(scores, ((0, 0), (0, pad))) if pad > 0 else scores


def simplex_centers(signals: jax.Array, endpoints: int) -> jax.Array:
  """[N, M] the clients' points: their PCA scores projected at the z of lowest energy."""
  kappas = pca_scores(signals, endpoints)

  def points(z):
    betas = project_simplex(kappas, z)
    return betas / jnp.sum(betas, axis=1, keepdims=True)

  def lower(best, z):
    close, rest = riesz_terms(points(z))
    # Better where its energy is lower, the difference taken term by term; the first
    # of equals stays (the codes' strict <); a non-finite energy never wins.
    better = (((close - best[1]) / MIN_DISTANCE**2 + (rest - best[2]) < 0)
              & jnp.isfinite(rest))
    return jax.tree.map(lambda n, o: jnp.where(better, n, o), (z, close, rest), best), None
  grid = jnp.linspace(1e-4, 1.0, ENERGY_GRID)
  start = (grid[0], jnp.asarray(jnp.inf, kappas.dtype), jnp.asarray(jnp.inf, kappas.dtype))
  (best, _, _), _ = jax.lax.scan(lower, start, grid)
  betas = project_simplex(kappas, best)
  return betas / jnp.sum(betas, axis=1, keepdims=True)


def uniform_simplex(key: jax.Array, endpoints: int) -> jax.Array:
  sample = jax.random.exponential(key, (endpoints,))
  return sample / jnp.sum(sample)


def l1_ball(key: jax.Array, center: jax.Array, radius: float) -> jax.Array:
  """center + r u: u uniform in [-1, 1]^M scaled to ||u||_1 = 1, r uniform in [0, radius]."""
  u_key, r_key = jax.random.split(key)
  u = jax.random.uniform(u_key, center.shape, minval=-1.0, maxval=1.0)
  return center + jax.random.uniform(r_key, (), maxval=radius) * u / jnp.sum(jnp.abs(u))


def xavier_endpoints(key: jax.Array, endpoints: int, dim: int, classes: int) -> jax.Array:
  """[M, d, C] kernels, each Xavier-normal (std sqrt(2 / (d + C)))."""
  return jax.random.normal(key, (endpoints, dim, classes)) * jnp.sqrt(2.0 / (dim + classes))


def floco(config: FlocoConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  tau = tau_rounds(config)
  num_endpoints = config.endpoints

  def init(context: InitContext) -> AlgorithmState:
    model = tree.first(context.params)
    dim, classes = model["params"][head_layer(model, "floco")]["kernel"].shape
    endpoints = xavier_endpoints(context.key, num_endpoints, dim, classes)
    num_clients = tree.leading_size(context.params)
    clients = FlocoClient(
        signal=jnp.zeros((num_clients, endpoints.size)),
        center=jnp.full((num_clients, num_endpoints), 1.0 / num_endpoints))
    server = FlocoServer(FlocoModel(model, endpoints), jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: FlocoServer, clients: FlocoClient):
    return tree.broadcast_to_clients(server, tree.leading_size(clients.center))

  def client_update(client: FlocoClient, message: FlocoServer, data, key):
    received = message.model
    head = head_layer(received.model, "floco")
    placed = message.round >= tau
    alpha_key, train_key = jax.random.split(key)

    def loss(params: FlocoModel, step, x, y, weights):
      step_key = jax.random.fold_in(alpha_key, step)
      alpha = jnp.where(placed, l1_ball(step_key, client.center, config.rho),
                        uniform_simplex(step_key, num_endpoints))
      kernel = jnp.einsum("m,mdc->dc", alpha, params.endpoints)
      return trainer.loss(with_kernel(params.model, head, kernel), x, y, weights), step + 1

    trained, stats, _ = trainer.train(received, data.train, train_key, loss_fn=loss,
                                      carry=jnp.zeros((), jnp.int32))
    signal = (received.endpoints - trained.endpoints if config.signal == "update"
              else trained.endpoints)
    return ClientOutput(state=client._replace(signal=signal.reshape(-1)), upload=trained,
                        train=stats)

  def aggregate(server: FlocoServer, clients: FlocoClient, uploads: FlocoModel, weights):
    model = tree.weighted_mean(uploads, weights)
    project = server.round + 1 == tau
    centers = jax.lax.cond(project, lambda s: simplex_centers(s, num_endpoints),
                           lambda _: clients.center, clients.signal)
    return AlgorithmState(server=FlocoServer(model, server.round + 1),
                          clients=clients._replace(center=centers))

  def personalized_params(server: FlocoServer, clients: FlocoClient):
    head = head_layer(server.model.model, "floco")
    kernels = jnp.einsum("km,mdc->kdc", clients.center, server.model.endpoints)
    models = tree.broadcast_to_clients(server.model.model, kernels.shape[0])
    return with_kernel(models, head, kernels)

  return Algorithm(name="floco", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params)
