"""APPLE: each client learns how much to take from every client's core model.

Luo, Wu. "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning." IJCAI 2022. https://arxiv.org/abs/2110.08394
We follow the authors' code, github.com/ljaiverson/pFL-APPLE (train_APPLE.py,
utils/apple.py, utils/losses.py, utils/models.py); PFLlib's port (TsingZ0/PFLlib
clientapple.py) differs where noted.

Client i holds copies of all N core models w_c^j and a DR vector p_i; each local step on
CE(w_p^i) + lambda(r) mu ||p_i - p_0||^2, w_p^i = sum_j p_ij w_c^j, trains its own core and
p_i. It uploads its core; the server sends every client's latest core out. A client is scored
with w_p^i. Defaults: mu 0.1, reg_rounds 16, p_lr_scale 0.1, p0 "sizes", num_models 0 (all).

Departures: schedule "cosine" (PFLlib's; "exponential" is the authors'); the run's optimizer
trains the core and p; the cores start shared (core_init="independent": the authors'); only
sampled clients train; PFLlib's form behind p_start, p_gradient, upload and lambda_round.

Details (every option, the departures, measurements): docs/algorithms/apple.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.data.client_data import FederatedData
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any

SCHEDULES = ("cosine", "exponential")
P0S = ("sizes", "uniform")
DOWNLOADS = ("weighted", "random")
CORE_INITS = ("shared", "independent")
P_STARTS = ("p0", "uniform")
P_GRADIENTS = ("exact", "pfllib")
UPLOADS = ("core", "mixture")
LAMBDA_ROUNDS = ("current", "previous")
# The authors' limited-bandwidth constants: --thresh 1.5 and --lamb 1.
DOWNLOAD_THRESHOLD, DOWNLOAD_LAMB = 1.5, 1.0


class AppleConfig(NamedTuple):
  mu: float = 0.1               # weight of the proximal term on p
  reg_rounds: int = 16          # L: lambda(r) reaches 0 at round L (authors: 10% of 160)
  schedule: str = "cosine"      # lambda(r): "cosine" or "exponential" (authors' default)
  p_lr_scale: float = 0.1       # p's step / the run's step (authors 0.001 / 0.01)
  core_lr_scale: float = 1.0    # the core model's step / the run's (PFLlib: N)
  p0: str = "sizes"             # p_0 and p's start: "sizes" (n_j / n) or "uniform"
  num_models: int = 0           # M core models refreshed per round; 0: all
  download: str = "weighted"    # M > 0: "weighted" (the authors' rule) or "random"
  core_init: str = "shared"     # "shared" initial model or "independent" (authors)
  p_start: str = "p0"           # p's start: p_0 (the paper's) or "uniform" (PFLlib's 1/N)
  p_gradient: str = "exact"     # "exact" or "pfllib" (its mean over tensors, core stepped)
  upload: str = "core"          # "core" (trained) or "mixture" (PFLlib: w_p before last step)
  lambda_round: str = "current" # lambda(r), or "previous": lambda(r - 1) (PFLlib's lag)


FLAG_HELP = {
    "mu": "APPLE: mu of the proximal term lambda(r) mu ||p_i - p_0||^2",
    "reg_rounds": "APPLE: rounds L after which lambda(r) is 0",
    "schedule": "APPLE: lambda(r), cosine ((cos(pi r / L) + 1) / 2) or exponential"
                " (0.001^(r / L), the authors' default)",
    "p_lr_scale": "APPLE: learning rate of the DR vectors p relative to the run's --lr"
                  " (authors: 0.001 / 0.01)",
    "core_lr_scale": "APPLE: the own core model's gradient step relative to the run's"
                     " --lr (the authors': 1; PFLlib: the number of clients)",
    "p0": "APPLE: p_0 and the initial p, sizes (training-set shares, the authors') or"
          " uniform (1/N)",
    "num_models": "APPLE: M other core models each client refreshes per round (0: all)",
    "download": "APPLE: with M > 0, weighted (never-downloaded first, then by |p_ij|) or"
                " random choice of the M",
    "core_init": "APPLE: core models start from the shared initial model (shared) or"
                 " independently initialised ones (independent, the authors')",
    "p_start": "APPLE: the DR vectors start at p0 (the paper's) or uniform (1/N, PFLlib's)",
    "p_gradient": "APPLE: p's gradient, exact or pfllib (a mean over tensors of means, the"
                  " own core already stepped: PFLlib's, under plain SGD)",
    "upload": "APPLE: the core model uploaded and the model scored: core (the trained"
              " core, its w_p from it) or mixture (w_p from before the last step, PFLlib's)",
    "lambda_round": "APPLE: lambda of the current round or the previous one (PFLlib's lag)",
}


class AppleServer(NamedTuple):
  cores: Params              # [N, ...] the latest core model of every client
  relations: jax.Array       # [N, N] p_ij as the clients last uploaded them (an artifact)
  p0: jax.Array              # [N] p_0
  downloaded: jax.Array      # [N, N] bool: client i has downloaded core j at least once
  round: jax.Array           # [] int32 rounds aggregated so far
  key: jax.Array             # raw PRNG key of the download choice


class AppleClient(NamedTuple):
  # [N] int32: the client's own index j (which core model is its own). The name shadows
  # tuple.index, never called here; checkpoints store it, so it stays.
  index: jax.Array  # type: ignore[assignment]
  p: jax.Array        # [N, N] p_i, the DR vectors
  personal: Params    # [N, ...] w_p^i as the client ended its last round
  copies: Params      # [N, N, ...] held copies of all core models when M > 0, else ()


class AppleMessage(NamedTuple):
  cores: Params       # [N, ...] per client: the server's core models
  fresh: jax.Array    # [N] bool per client: which of them the client downloads
  p0: jax.Array       # [N]
  round: jax.Array    # [] int32


class AppleTrained(NamedTuple):
  """What one client's local SGD updates."""
  core: Params        # its own core model w_c^i
  q: jax.Array        # [N]: p_i = p_start + sqrt(p_lr_scale) q


def validate(config: AppleConfig) -> AppleConfig:
  if config.mu < 0:
    raise FieldError("apple", "mu", f"must be >= 0, got {config.mu}")
  if config.reg_rounds < 1:
    raise FieldError("apple", "reg_rounds", f"must be >= 1, got {config.reg_rounds}")
  if config.p_lr_scale < 0:
    raise FieldError("apple", "p_lr_scale", f"must be >= 0, got {config.p_lr_scale}")
  if config.core_lr_scale < 0:
    raise FieldError("apple", "core_lr_scale", f"must be >= 0, got {config.core_lr_scale}")
  if config.num_models < 0:
    raise FieldError("apple", "num_models", f"must be >= 0, got {config.num_models}")
  for field, allowed in (("schedule", SCHEDULES), ("p0", P0S), ("download", DOWNLOADS),
                         ("core_init", CORE_INITS), ("p_start", P_STARTS),
                         ("p_gradient", P_GRADIENTS), ("upload", UPLOADS),
                         ("lambda_round", LAMBDA_ROUNDS)):
    check_one_of("apple", config, field, allowed)
  return config


def reg_schedule(round_index: jax.Array, config: AppleConfig) -> jax.Array:
  """lambda(r): from 1 at r = 0 down to 0 at r = L, 0 after."""
  phase = round_index / config.reg_rounds
  if config.schedule == "cosine":
    value = (jnp.cos(jnp.pi * phase) + 1.0) / 2.0
  else:
    value = 0.001 ** phase
  return jnp.where(round_index < config.reg_rounds, value, 0.0)


def personalized_model(p: jax.Array, cores: Params) -> Params:
  """w_p = sum_j p_j w_c^j from p [N] and cores [N, ...]."""
  return tree.mix(p, cores)


def with_own_core(cores: Params, index: jax.Array, core: Params) -> Params:
  return jax.tree.map(lambda c, own: c.at[index].set(own), cores, core)


def scale_gradient(params: Params, factor: float) -> Params:
  """The same values, with gradients multiplied by `factor` on the way back."""
  if factor == 1.0:
    return params
  return jax.tree.map(lambda a: jax.lax.stop_gradient(a) + factor * (a - jax.lax.stop_gradient(a)),
                      params)


def tensor_weights(model: Params) -> Params:
  """1 / (T size_t) for each of a model's T tensors: sum_t w_t <a_t, b_t> is the mean over
  the tensors of mean(a_t * b_t) (PFLlib's p gradient)."""
  count = len(jax.tree.leaves(model))
  return jax.tree.map(lambda a: 1.0 / (count * a.size), model)


def apple_mixture(cores: Params, index: jax.Array, p_start: jax.Array, p_scale: float,
                  core_scale: float, p_gradient: str = "exact"):
  """mixture(AppleTrained) = sum_j p_j w_c^j, the other cores fixed.

  The mixture is sum_j p_j cores_j + p_i (w_c^i - cores_i): the held cores mixed once,
  plus the own core's change, so no [N, ...] copy is written per step. With p_gradient
  "pfllib" its value is the same, and p's gradient sum_t w_t <grad_t, w_c^j_t>
  (tensor_weights), through a zero term b - stop_gradient(b) that only p reaches."""
  own_start = tree.take(cores, index)
  weights = tensor_weights(own_start)

  def mix(p, core):
    return jax.tree.map(lambda m, c, c0: m + p[index] * (c - c0),
                        personalized_model(p, cores), core, own_start)

  def mixture(trained: AppleTrained) -> Params:
    p = p_start + p_scale * trained.q
    core = scale_gradient(trained.core, core_scale)
    if p_gradient == "exact":
      return mix(p, core)
    held = mix(jax.lax.stop_gradient(p), core)
    probe = mix(p, jax.lax.stop_gradient(core))
    return jax.tree.map(lambda m, b, w: m + w * (b - jax.lax.stop_gradient(b)),
                        held, probe, weights)
  return mixture


def apple_loss(trainer: ClientTrainer, cores: Params, index: jax.Array, p_start: jax.Array,
               p_scale: float, core_scale: float, p_gradient: str = "exact"):
  """loss_fn(AppleTrained, x, y, weights) = CE(sum_j p_j w_c^j) (apple_mixture)."""
  mixture = apple_mixture(cores, index, p_start, p_scale, core_scale, p_gradient)
  return lambda trained, x, y, weights: trainer.loss(mixture(trained), x, y, weights)


def stepped_core_term(p_start: jax.Array, index: jax.Array, p_scale: float,
                      core_scale: float):
  """post_step for p_gradient "pfllib": p_ii's gradient read after the own core's step.

  PFLlib steps the core by dw = -eta p_ii g, then p_ii by its gradient with the stepped
  core, mean_t mean(g_t (w_t + dw_t)): beyond the gradient at the step's start, a step of
  -rho mean_t mean(g_t dw_t) = (rho / (eta p_ii)) mean_t mean(dw_t^2), rho / eta =
  p_lr_scale / core_lr_scale (lr cancels); on q (p = p_start + p_scale q) that is
  p_scale / core_lr_scale times it. Exact under plain SGD (dw proportional to g)."""
  def post_step(new: AppleTrained, old: AppleTrained) -> AppleTrained:
    if p_scale == 0.0 or core_scale == 0.0:
      return new
    p_own = p_start[index] + p_scale * old.q[index]
    moved = jax.tree.map(lambda a, b: a - b, new.core, old.core)
    squares = jnp.mean(jnp.stack([jnp.mean(jnp.square(d)) for d in jax.tree.leaves(moved)]))
    term = jnp.where(p_own != 0, squares / jnp.where(p_own != 0, p_own, 1.0), 0.0)
    return new._replace(q=new.q.at[index].add(p_scale / core_scale * term))
  return post_step


def download_choice(relations: jax.Array, downloaded: jax.Array, key: jax.Array,
                    round_index: jax.Array, num_models: int, rule: str) -> jax.Array:
  """[N, N] bool: the M other core models each client refreshes (its own excluded)."""
  num_clients = relations.shape[0]
  others = ~jnp.eye(num_clients, dtype=bool)
  gumbel = jax.random.gumbel(key, relations.shape)
  if rule == "random":
    score = gumbel
  else:
    base = jnp.maximum(DOWNLOAD_THRESHOLD, round_index * num_models / num_clients
                       * DOWNLOAD_LAMB)
    # Sampling without replacement with probabilities base^|p_ij| (Gumbel top-M); never
    # downloaded models rank above all others.
    weighted = jnp.abs(relations) * jnp.log(base) + gumbel
    score = jnp.where(downloaded, weighted, 1e6 + gumbel)
  score = jnp.where(others, score, -jnp.inf)
  ranks = jnp.argsort(jnp.argsort(-score, axis=1), axis=1)
  return (ranks < num_models) & others


def train_sizes(data: FederatedData) -> jax.Array:
  """[N] training-set sizes, in client order (traceable: init runs under jit)."""
  sizes = jnp.zeros((data.num_clients,), jnp.float32)
  for ids, bucket in zip(data.client_ids, data.buckets):
    sizes = sizes.at[ids].set(jnp.asarray(bucket.train.n[:len(ids)], jnp.float32))
  return sizes


def apple(config: AppleConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)
  scale = float(np.sqrt(config.p_lr_scale))

  def limited(num_clients: int) -> bool:
    return 0 < config.num_models < num_clients - 1

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    if num_clients < 2:
      raise ConfigError("apple needs at least 2 clients")
    init_key, download_key = jax.random.split(context.key)
    cores = context.params
    if config.core_init == "independent":
      cores = tree.random_models(tree.first(context.params), init_key, num_clients)
    if config.p0 == "sizes":
      sizes = train_sizes(context.data)
      p0 = sizes / jnp.sum(sizes)
    else:
      p0 = jnp.full((num_clients,), 1.0 / num_clients, jnp.float32)
    start = p0 if config.p_start == "p0" else jnp.full((num_clients,), 1.0 / num_clients,
                                                         jnp.float32)
    p = jnp.broadcast_to(start, (num_clients, num_clients))
    copies = tree.broadcast_to_clients(cores, num_clients) if limited(num_clients) else ()
    clients = AppleClient(index=jnp.arange(num_clients, dtype=jnp.int32), p=p,
                          personal=tree.broadcast_to_clients(personalized_model(start, cores),
                                                             num_clients),
                          copies=copies)
    server = AppleServer(cores=cores, relations=p, p0=p0,
                         downloaded=jnp.eye(num_clients, dtype=bool),
                         round=jnp.zeros((), jnp.int32),
                         key=raw_key(download_key))
    return AlgorithmState(server=server, clients=clients)

  def broadcast(server: AppleServer, clients: AppleClient):
    num_clients = clients.p.shape[0]
    if limited(num_clients):
      key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
      chosen = download_choice(clients.p, server.downloaded, key, server.round,
                               config.num_models, config.download)
      fresh = (chosen | jnp.eye(num_clients, dtype=bool)) | (server.round == 0)
    else:
      fresh = jnp.ones((num_clients, num_clients), bool)
    return AppleMessage(cores=tree.broadcast_to_clients(server.cores, num_clients),
                        fresh=fresh,
                        p0=jnp.broadcast_to(server.p0, (num_clients, num_clients)),
                        round=jnp.broadcast_to(server.round, (num_clients,)))

  def client_update(client: AppleClient, message: AppleMessage, data, key):
    if isinstance(client.copies, tuple):
      cores = message.cores
      copies = ()
    else:
      cores = jax.tree.map(
          lambda new, old: jnp.where(
              message.fresh.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
          message.cores, client.copies)
      copies = cores
    own = tree.take(cores, client.index)
    round_index = message.round
    if config.lambda_round == "previous":  # PFLlib sets lambda after training
      round_index = jnp.maximum(round_index - 1, 0)
    coef = config.mu * reg_schedule(round_index, config)

    def proximal(trained: AppleTrained):
      p = client.p + scale * trained.q
      return coef * jnp.sum(jnp.square(p - message.p0))

    start = AppleTrained(core=own, q=jnp.zeros_like(client.p))
    mixture = apple_mixture(cores, client.index, client.p, scale, config.core_lr_scale,
                            config.p_gradient)
    post_step = (stepped_core_term(client.p, client.index, scale, config.core_lr_scale)
                 if config.p_gradient == "pfllib" else None)
    if config.upload == "mixture":
      # The carry: the mixture each step starts from; the last one is w_p before the
      # last step.
      def carried(trained, _, x, y, weights):
        mixed = mixture(trained)
        return trainer.loss(mixed, x, y, weights), jax.lax.stop_gradient(mixed)
      trained, stats, before_last = trainer.train(
          start, data.train, key, regularizer=proximal, post_step=post_step,
          loss_fn=carried, carry=mixture(start))
      uploaded = before_last
    else:
      trained, stats = trainer.train(
          start, data.train, key, regularizer=proximal, post_step=post_step,
          loss_fn=lambda trained, x, y, weights: trainer.loss(mixture(trained), x, y,
                                                               weights))
      uploaded = trained.core
    p = client.p + scale * trained.q
    cores = with_own_core(cores, client.index, trained.core)
    personal = personalized_model(p, cores) if config.upload == "core" else uploaded
    copies = copies if isinstance(copies, tuple) else with_own_core(cores, client.index,
                                                                   uploaded)
    state = AppleClient(index=client.index, p=p, personal=personal, copies=copies)
    return ClientOutput(state=state, upload=(uploaded, message.fresh), train=stats,
                        metrics={"p_self": p[client.index], "lambda_mu": coef})

  def aggregate(server: AppleServer, clients: AppleClient, uploads, weights):
    cores, fresh = uploads
    sampled = weights > 0
    # Only the round's sampled clients upload a core model; the others' stay.
    cores = jax.tree.map(
        lambda new, old: jnp.where(sampled.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        cores, server.cores)
    return AlgorithmState(
        server=server._replace(cores=cores, relations=clients.p,
                               downloaded=server.downloaded | (fresh & sampled[:, None]),
                               round=server.round + 1),
        clients=clients)

  return Algorithm(name="apple", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: clients.personal,
                   artifacts=lambda server: {"directed_relationships": server.relations})
