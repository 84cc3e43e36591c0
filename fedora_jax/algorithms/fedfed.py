"""FedFed: clients distil each input into performance-sensitive and performance-robust
features, share the sensitive ones under noise, and train on their data and the pool.

Yang, Zhang, Zheng, Tian, Peng, Liu, Han. "FedFed: Feature Distillation against Data
Heterogeneity in Federated Learning." NeurIPS 2023. https://arxiv.org/abs/2310.05077
(code read, not run or copied: the authors' visitworld123/FedFed (basePS/client.py,
basePSmanager.py, model/FL_VAE.py, configs/default.py) and FL-bench's src/server/fedfed.py
and src/client/fedfed.py, KarhouTam/FL-bench, GPL. The paper's full text is not on disk.)

Before the rounds (in `init`), for distill_rounds 15 every client trains a beta-VAE G that
splits x into x_r = G(x) and x_s = x - x_r, and a classifier f on the noised x_s, then
shares x_s + n1 and x_s + n2 (noise_std1 0.15, noise_std2 0.25) of every training sample:
the pool every client holds. The rounds are FedAvg (FedProx with mu > 0) on the client's
data and pool rows (mix "batch", the authors', or "union"); the global model is scored.

Departures: no data augmentation, no curriculum (--fedfed_re=50 sets it) nor skew-adaptive
weights; every client distils in every stage round; draws once a round, not once an epoch.

Details (every option, the departures, measurements): docs/algorithms/fedfed.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedora_jax import tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.fedfomo import raw_key
from fedora_jax.algorithms.layers import in_chunks
from fedora_jax.data.client_data import ClientData
from fedora_jax.engine import shared_pool
from fedora_jax.engine.local_training import (ClientTrainer, epoch_batches, make_optimizer,
                                              masked_cross_entropy)
from fedora_jax.errors import ConfigError, FieldError, check_one_of, traced
from fedora_jax.models.feature_vae import (ARCHITECTURES, FeatureVAE, architecture_for,
                                           init_vae)
from fedora_jax.models.mlp import normalize_inputs

Params = Any
CLASSIFIERS = ("separate", "model")
NOISES = ("gaussian", "laplace")
NOISE_DRAWS = ("sample", "batch")
MIXES = ("batch", "union")
GENERATE_CHUNK = 256  # samples per forward pass when a client makes its shared features


class FedFedConfig(NamedTuple):
  distill_rounds: int = 15       # feature-distillation rounds before FL (VAE_comm_round)
  vae_epochs: int = 1            # each client's passes of steps 1-3 a stage round
  architecture: str = "auto"     # conv (images), mlp (vectors) or auto
  vae_depth: int = 32            # the conv VAE's block depth d (the mlp's width)
  vae_lr: float = 1e-3           # G's AdamW
  vae_weight_decay: float = 1e-6
  mixup_alpha: float = 2.0       # Beta(alpha, alpha) of step 1's mixup
  re: float = 5.0                # reconstruction weight
  kl: float = 0.005              # KL weight
  ce: float = 2.0                # weight of CE on the noised sensitive features
  x_ce: float = 0.4              # weight of CE on the inputs themselves
  noise: str = "gaussian"        # gaussian or laplace
  noise_std1: float = 0.15       # the first shared set's noise scale
  noise_std2: float = 0.25       # the second's
  noise_draw: str = "sample"     # sample (paper, FL-bench) or batch (the authors')
  classifier: str = "separate"   # separate (the authors') or model (FL-bench's)
  mix: str = "batch"             # batch (the authors') or union (FL-bench's)
  mu: float = 0.0                # FedProx's proximal weight in the rounds (0: FedAvg)
  lr: float = 5e-3               # the run's SGD, for f in step 3 (train fields)
  momentum: float = 0.9
  weight_decay: float = 5e-5


FLAG_HELP = {
    "distill_rounds": "FedFed: feature-distillation rounds before the FL rounds (the"
                      " generator and classifier averaged each)",
    "vae_epochs": "FedFed: each client's mixup, VAE and joint epochs a distillation round",
    "architecture": "FedFed: the generator, conv (the codes' residual VAE, images with"
                    " sides divisible by 4), mlp (feature vectors) or auto",
    "vae_depth": "FedFed: the conv VAE's block depth (the mlp VAE's width)",
    "vae_lr": "FedFed: learning rate of the generator's AdamW",
    "vae_weight_decay": "FedFed: weight decay of the generator's AdamW",
    "mixup_alpha": "FedFed: Beta(alpha, alpha) of the classifier's mixup epoch",
    "re": "FedFed: weight of the reconstruction MSE (the authors' curriculum: 50)",
    "kl": "FedFed: weight of the VAE's KL term",
    "ce": "FedFed: weight of CE on the noised performance-sensitive features",
    "x_ce": "FedFed: weight of CE on the raw inputs in the joint epoch",
    "noise": "FedFed: noise on the shared features, gaussian or laplace",
    "noise_std1": "FedFed: scale of the first shared set's noise",
    "noise_std2": "FedFed: scale of the second shared set's noise",
    "noise_draw": "FedFed: a noise draw per sample (sample, paper and FL-bench) or one"
                  " per batch (batch, the authors' code)",
    "classifier": "FedFed: the distillation's classifier, its own and dropped (separate,"
                  " the authors') or the global model (model, FL-bench's)",
    "mix": "FedFed: per step B own samples beside B class-balanced rows of each noised"
           " set (batch, the authors') or own data plus n uniform pool rows (union,"
           " FL-bench's)",
    "mu": "FedFed: FedProx's proximal weight in the FL rounds (0: FedAvg)",
}


class FedFedServer(NamedTuple):
  params: Params               # the global model
  pools: tuple                 # (SharedPool,) x 2 (batch) or x 1 (union)
  slots: jax.Array             # [S] zeros: S, the largest client's padded training rows
  classes: jax.Array           # [C] zeros: C, the number of classes
  key: jax.Array               # raw key of the rounds' draws
  round: jax.Array             # [] int32


class FedFedMessage(NamedTuple):
  params: Params
  x: jax.Array                 # [S, L, ...] the drawn pool rows, L = 2 (batch) or 1
  y: jax.Array                 # [S, L]
  weights: jax.Array           # [S] 1 for the first n_k rows


def validate(config: FedFedConfig, trainer: ClientTrainer) -> FedFedConfig:
  for field in ("distill_rounds", "vae_epochs", "vae_depth"):
    if getattr(config, field) < (0 if field == "distill_rounds" else 1):
      raise FieldError("fedfed", field, f"must be >= {int(field != 'distill_rounds')},"
                       f" got {getattr(config, field)}")
  if config.vae_depth % 2:
    raise FieldError("fedfed", "vae_depth", f"must be even, got {config.vae_depth}")
  for field in ("vae_lr", "mixup_alpha"):
    value = getattr(config, field)
    if not traced(value) and not value > 0:
      raise FieldError("fedfed", field, f"must be > 0, got {value}")
  for field in ("vae_weight_decay", "re", "kl", "ce", "x_ce", "noise_std1", "noise_std2",
                "mu"):
    value = getattr(config, field)
    if not traced(value) and not value >= 0:
      raise FieldError("fedfed", field, f"must be >= 0, got {value}")
  check_one_of("fedfed", config, "architecture", ("auto",) + ARCHITECTURES)
  check_one_of("fedfed", config, "noise", NOISES)
  check_one_of("fedfed", config, "noise_draw", NOISE_DRAWS)
  check_one_of("fedfed", config, "classifier", CLASSIFIERS)
  check_one_of("fedfed", config, "mix", MIXES)
  if trainer.task != "classification" or trainer.apply is None:
    raise ConfigError("fedfed needs a classification task and the model's forward")
  return config


def noise_of(key: jax.Array, shape: tuple[int, ...], scale: float, noise: str,
             draw: str) -> jax.Array:
  """Noise for a batch of `shape`: N(0, scale^2) or Laplace(0, scale) per element, one draw
  per sample ("sample") or one of a sample's shape for the whole batch ("batch")."""
  drawn = shape if draw == "sample" else (1,) + tuple(shape[1:])
  sample = jax.random.normal if noise == "gaussian" else jax.random.laplace
  return jnp.broadcast_to(scale * sample(key, drawn), shape)


def reconstruction_loss(x_r: jax.Array, x: jax.Array, weights: jax.Array) -> jax.Array:
  """MSE over the real samples and every input dimension."""
  per_sample = jnp.mean(jnp.square(x_r - x).reshape(x.shape[0], -1), axis=1)
  return jnp.sum(per_sample * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def kl_loss(mu: jax.Array, logvar: jax.Array, weights: jax.Array) -> jax.Array:
  """-1/2 sum (1 + logvar - mu^2 - e^logvar) over the real samples and the latent, over
  (real samples x 3 x latent width), both codes' normalisation."""
  per_sample = jnp.sum(1 + logvar - jnp.square(mu) - jnp.exp(logvar), axis=1)
  scale = jnp.maximum(jnp.sum(weights), 1.0) * 3 * mu.shape[1]
  return -0.5 * jnp.sum(per_sample * weights) / scale


def mixup_partners(key: jax.Array, weights: jax.Array) -> jax.Array:
  """[B] a random permutation of a batch's real rows (a prefix of it), padding fixed."""
  ranks = jnp.where(weights > 0, jax.random.uniform(key, weights.shape),
                    2.0 + jnp.arange(weights.shape[0]))
  return jnp.argsort(ranks)


def mixup_loss(apply_fn, alpha: float, key: jax.Array):
  """Step 1's carried loss: lam CE(f(x~), y) + (1 - lam) CE(f(x~), y'), a step's draws
  from fold_in(key, its count)."""
  def loss(params, step, x, y, weights):
    lam_key, perm_key = jax.random.split(jax.random.fold_in(key, step))
    lam = jax.random.beta(lam_key, alpha, alpha)
    partners = mixup_partners(perm_key, weights)
    x = normalize_inputs(x)
    logits = apply_fn(params, lam * x + (1 - lam) * x[partners])
    value = (lam * masked_cross_entropy(logits, y, weights)
             + (1 - lam) * masked_cross_entropy(logits, y[partners], weights))
    return value, step + 1
  return loss


def mixed_batch_loss(apply_fn):
  """mix "batch": x [B, 3, ...] (own, first set, second set), the mean CE over the 3B."""
  def loss(params, x, y, weights):
    return sum(masked_cross_entropy(apply_fn(params, x[:, i]), y[:, i], weights)
               for i in range(3)) / 3
  return loss


def mixed_data(own: ClientData, x: jax.Array, y: jax.Array, weights: jax.Array,
               mix: str) -> ClientData:
  """One client's training data with its drawn pool rows (x [N, L, ...], y [N, L])."""
  own_x = normalize_inputs(jnp.asarray(own.x))
  if mix == "batch":
    return own._replace(x=jnp.concatenate([own_x[:, None], x], axis=1),
                        y=jnp.concatenate([own.y[:, None], y], axis=1))
  return ClientData(x=jnp.concatenate([own_x, x[:, 0]]), y=jnp.concatenate([own.y, y[:, 0]]),
                    mask=jnp.concatenate([own.mask, weights > 0]),
                    n=own.n + jnp.sum(weights > 0).astype(own.n.dtype))


def fedfed(config: FedFedConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config, trainer)
  apply_fn = trainer.apply
  assert apply_fn is not None  # validate checked it
  batch_size = trainer.batch_size
  vae_optimizer = optax.adamw(config.vae_lr, b1=0.9, b2=0.999, eps=1e-8,
                              weight_decay=config.vae_weight_decay)
  classifier_optimizer = make_optimizer(config.lr, config.momentum, config.weight_decay)
  levels = (config.noise_std1, config.noise_std2)

  def vae_epoch(vae: FeatureVAE, variables, opt_state, classifier, data: ClientData,
                key: jax.Array, joint: bool):
    """Step 2 (joint False: G alone) or 3 (G and f): one epoch of G's loss over `data`."""
    num_batches = trainer.steps_per_epoch(data.mask.shape[0])
    order_key, step_key = jax.random.split(key)
    indices, weights = epoch_batches(order_key, data.mask, data.n, batch_size, num_batches)

    def loss(vae_params, stats, f, x, y, w, step_key):
      reparam_key, key1, key2 = jax.random.split(step_key, 3)
      (x_r, mu, logvar), new_stats = vae.apply(
          {"params": vae_params, **stats}, x, reparam_key, w > 0, True,
          mutable=["batch_stats"])
      total = config.re * reconstruction_loss(x_r, x, w) + config.kl * kl_loss(mu, logvar, w)
      if joint:
        x_s = x - x_r
        noised = [masked_cross_entropy(apply_fn(f, x_s + noise_of(k, x.shape, std,
                                                                  config.noise,
                                                                  config.noise_draw)), y, w)
                  for k, std in zip((key1, key2), levels)]
        total += (config.ce * (noised[0] + noised[1]) / 2
                  + config.x_ce * masked_cross_entropy(apply_fn(f, x), y, w))
      return total, new_stats

    def step(carry, batch):
      variables, opt_state, f, f_state = carry
      ids, w, t = batch
      x, y = normalize_inputs(data.x[ids]), data.y[ids]
      stats = {k: v for k, v in variables.items() if k != "params"}
      (_, new_stats), (g_vae, g_f) = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)(
          variables["params"], stats, f, x, y, w, jax.random.fold_in(step_key, t))
      updates, new_opt = vae_optimizer.update(g_vae, opt_state, variables["params"])
      new_vars = {**variables, **new_stats,
                  "params": optax.apply_updates(variables["params"], updates)}
      new_f, new_f_state = f, f_state
      if joint:
        f_updates, new_f_state = classifier_optimizer.update(g_f, f_state, f)
        new_f = optax.apply_updates(f, f_updates)
      active = jnp.sum(w) > 0
      new = (new_vars, new_opt, new_f, new_f_state)
      return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry), None

    carry = (variables, opt_state, classifier, classifier_optimizer.init(classifier))
    (variables, opt_state, classifier, _), _ = jax.lax.scan(
        step, carry, (indices, weights, jnp.arange(num_batches)))
    return variables, opt_state, classifier

  def distill_client(vae: FeatureVAE, classifier, variables, opt_state, data: ClientData,
                     key: jax.Array):
    """One client's stage round: `vae_epochs` of steps 1, 2 and 3."""
    for epoch in range(config.vae_epochs):
      mix_key, vae_key, joint_key, step_key = jax.random.split(
          jax.random.fold_in(key, epoch), 4)
      classifier, _, _ = trainer.train(classifier, data, mix_key,
                                       loss_fn=mixup_loss(apply_fn, config.mixup_alpha,
                                                          step_key),
                                       epochs=1, carry=jnp.zeros((), jnp.int32))
      variables, opt_state, _ = vae_epoch(vae, variables, opt_state, classifier, data,
                                          vae_key, joint=False)
      variables, opt_state, classifier = vae_epoch(vae, variables, opt_state, classifier,
                                                   data, joint_key, joint=True)
    return classifier, variables, opt_state

  def shared_features(vae: FeatureVAE, variables, x: jax.Array, key: jax.Array):
    """[N, 2, ...] one client's x_s + n1 and x_s + n2, G's mean reconstruction."""
    size = x.shape[0]
    chunk = min(size, GENERATE_CHUNK)

    def one_chunk(batch):
      xb, chunk_key = batch
      xb = normalize_inputs(xb)
      x_r, _, _ = vae.apply(variables, xb, chunk_key)
      keys = jax.random.split(chunk_key, 2)
      return jnp.stack([xb - x_r + noise_of(k, xb.shape, std, config.noise,
                                            config.noise_draw)
                        for k, std in zip(keys, levels)], axis=1)
    chunks = in_chunks(x, chunk)
    features = jax.lax.map(one_chunk, (chunks, jax.random.split(key, chunks.shape[0])))
    return features.reshape((-1,) + features.shape[2:])[:size]

  def init(context: InitContext) -> AlgorithmState:
    data = context.data
    x_shape = tuple(data.input_shape)
    architecture = architecture_for(x_shape, config.architecture)
    if architecture is None:
      raise ConfigError(f"fedfed: --fedfed_architecture=conv needs images [H, W, C] with"
                        f" H and W divisible by 4; the inputs are {list(x_shape)}")
    vae = FeatureVAE(architecture=architecture, depth=config.vae_depth)
    vae_key, stage_key, share_key, server_key = jax.random.split(context.key, 4)
    initial = tree.first(context.params)
    variables = init_vae(vae, vae_key, x_shape)
    trains = [bucket.train for bucket in data.buckets]
    weights = [b.n.astype(jnp.float32) for b in trains]
    total = sum(jnp.sum(w) for w in weights)
    opt_states = tuple(tree.broadcast_to_clients(vae_optimizer.init(variables["params"]),
                                                 b.n.shape[0]) for b in trains)

    def stage_round(carry, r):
      classifier, variables, opt_states = carry
      new_states, sums = [], None
      for b, (train, w) in enumerate(zip(trains, weights)):
        keys = jax.random.split(jax.random.fold_in(jax.random.fold_in(stage_key, r), b),
                                w.shape[0])
        f_k, vars_k, opt_k = jax.vmap(
            lambda o, d, k: distill_client(vae, classifier, variables, o, d, k))(
                opt_states[b], train, keys)
        new_states.append(opt_k)
        part = jax.tree.map(lambda leaf, w=w: jnp.tensordot(w, leaf, axes=(0, 0)), (f_k, vars_k))
        sums = part if sums is None else jax.tree.map(jnp.add, sums, part)
      classifier, variables = jax.tree.map(lambda s: s / total, sums)
      return (classifier, variables, tuple(new_states)), None

    classifier = initial
    if config.distill_rounds:  # a scan of none would still compile the stage
      (classifier, variables, _), _ = jax.lax.scan(
          stage_round, (initial, variables, opt_states), jnp.arange(config.distill_rounds))
    parts = []
    for b, train in enumerate(trains):
      keys = jax.random.split(jax.random.fold_in(share_key, b), train.n.shape[0])
      features = jax.vmap(lambda x, k: shared_features(vae, variables, x, k))(train.x, keys)
      parts.append([shared_pool.pool_of(features[:, :, level], jnp.asarray(train.y),
                                          jnp.asarray(train.mask))
                    for level in range(2)])
    pools = tuple(shared_pool.concatenate(level) for level in zip(*parts))
    if config.mix == "union":
      pools = (shared_pool.concatenate(pools),)
    sizes = jnp.zeros((data.num_clients,), jnp.int32)
    for ids, train in zip(data.client_ids, trains):
      sizes = sizes.at[jnp.asarray(ids)].set(train.n.astype(jnp.int32))
    server = FedFedServer(
        params=classifier if config.classifier == "model" else initial, pools=pools,
        slots=jnp.zeros((max(t.mask.shape[1] for t in trains),), jnp.float32),
        classes=jnp.zeros((data.num_classes,), jnp.float32),
        key=raw_key(server_key), round=jnp.zeros((), jnp.int32))
    return AlgorithmState(server=server, clients=sizes)

  def draw(pool: shared_pool.SharedPool, key: jax.Array, n: jax.Array, size: int,
           num_classes: int):
    if config.mix == "batch":
      return shared_pool.draw_balanced(key, pool.y, pool.mask, n, size, num_classes)
    return shared_pool.draw_uniform(key, pool.mask, n, size)

  def broadcast(server: FedFedServer, sizes):
    size, num_classes = server.slots.shape[0], server.classes.shape[0]
    round_key = jax.random.fold_in(jax.random.wrap_key_data(server.key), server.round)
    keys = jax.random.split(round_key, sizes.shape[0] * len(server.pools))
    keys = keys.reshape((sizes.shape[0], len(server.pools)) + keys.shape[1:])
    xs, ys, weights = [], [], []
    for level, pool in enumerate(server.pools):
      indices, w = jax.vmap(lambda k, n, pool=pool: draw(pool, k, n, size, num_classes))(
          keys[:, level], sizes)
      xs.append(pool.x[indices])
      ys.append(pool.y[indices])
      weights.append(w)
    # Every level's draw counts the client's n_k rows alike.
    return FedFedMessage(params=tree.broadcast_to_clients(server.params, sizes.shape[0]),
                         x=jnp.stack(xs, axis=2), y=jnp.stack(ys, axis=2),
                         weights=weights[0])

  def client_update(size, message: FedFedMessage, data, key):
    rows = data.train.mask.shape[0]
    train = mixed_data(data.train, message.x[:rows], message.y[:rows],
                       message.weights[:rows], config.mix)
    global_params = message.params
    regularizer = None
    if config.mu > 0:
      def regularizer(p):
        return config.mu / 2 * tree.squared_distance(p, global_params)
    params, stats = trainer.train(
        global_params, train, key, regularizer=regularizer,
        loss_fn=mixed_batch_loss(apply_fn) if config.mix == "batch" else None)
    return ClientOutput(state=size, upload=params, train=stats)

  def aggregate(server: FedFedServer, sizes, uploads, weights):
    server = server._replace(params=tree.weighted_mean(uploads, weights),
                             round=server.round + 1)
    return AlgorithmState(server=server, clients=sizes)

  def personalized_params(server: FedFedServer, sizes):
    return tree.broadcast_to_clients(server.params, sizes.shape[0])

  return Algorithm(name="fedfed", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=personalized_params,
                   shared_model=lambda server: server.params, uploads_unordered=True,
                   preshared=lambda message: (message.x, message.y, message.weights))
