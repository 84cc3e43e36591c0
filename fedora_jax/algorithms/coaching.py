"""Knowledge-aware parameter coaching: each client's training is pulled towards a
layer-wise combination of all clients' parameters, the combination weights (the
relation cube) being learned by the server.

Zhi, Bi, Xu, Wang, Xiang. "Knowledge-Aware Parameter Coaching for Personalized Federated
Learning." AAAI 2024 (Proceedings of the AAAI Conference on Artificial Intelligence
38(15), pp. 17069-17077). Equation numbers below are the paper's. No public code of the
paper was available to us.

Each round the server takes r_steps steps on the relation cube R [N, L, N] (Eq. 10-12) and
sends client i s_i^l = sum_j r_ij^l w_j^l (Eq. 14); a sampled client trains its own w_i on
f_i(w_i) + lam ||w_i - s_i||^2 (Eq. 15-16) and uploads it; it is scored with w_i.
CoachingConfig: lam 1, beta 0.01, r_steps 1, r_init "random", lr_r_rule "lipschitz".

Departures: eta_r = 1/L_r (Theorem 1), as the set-up's 0.01 (lr_r_rule="fixed") diverges;
f_s read as the squared distance (fs="norm"); R steps every row under client selection.

Details (every option, the departures, measurements): docs/algorithms/coaching.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedora_jax import linalg, tree
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.algorithms.layers import layer_names
from fedora_jax.engine.local_training import ClientTrainer
from fedora_jax.errors import ConfigError, FieldError, check_one_of

Params = Any

COACHING_LOSSES = ("squared", "norm")
R_CONSTRAINTS = ("none", "simplex_others")
R_INITS = ("random", "uniform")
LR_R_RULES = ("fixed", "lipschitz", "exact")


class CoachingConfig(NamedTuple):
  lam: float = 1.0      # lambda (Eq. 5): coaching strength in the client loss and R's loss
  beta: float = 0.01    # beta (Eq. 5): pull of R towards 1/N (paper: 1 at alpha 0.3)
  lr_r: float = 0.01    # eta_r (Eq. 11): learning rate of R
  r_steps: int = 1      # E_r (Algorithm 1): gradient steps on R per round
  r_init: str = "random"      # Algorithm 1 line 2; "uniform" is a deviation
  r_constraint: str = "none"  # Eq. 11's plain step; "simplex_others" is a deviation
  # Theorem 1's eta_r = 1/L_r; "fixed" (eta_r = lr_r, the set-up's 0.01) diverges on real
  # models, see docs/algorithms/coaching.md.
  lr_r_rule: str = "lipschitz"
  # f_s, the paper's "l_2-norm": its square (Eq. 6 = Eq. 5 and Assumption 2 need it) or,
  # read literally, the norm itself ("norm", with lr_r_rule="fixed": it has no L_r).
  fs: str = "squared"


FLAG_HELP = {
    "lam": "Coaching: lambda, client loss + lambda ||w_i - s_i||^2 (also weighs R's loss;"
           " the centre of the paper's Figure 3 sweeps)",
    "beta": "Coaching: beta of the regulariser beta/2 ||r_i - 1/N||^2 of the relation cube"
            " (the paper's Figure 3 centres: 0.01 at Dirichlet alpha 0.1, 1 at alpha 0.3)",
    "lr_r": "Coaching: learning rate eta_r of the relation cube (with coach_lr_r_rule=fixed)",
    "r_steps": "Coaching: gradient steps E_r on the relation cube per round",
    "r_init": "Coaching: relation cube starts 'random' (rows uniform on the simplex) or,"
              " a deviation, 'uniform' (1/N)",
    "r_constraint": "Coaching: 'none' (the paper's plain gradient step, r_ii included) or,"
                    " a deviation, 'simplex_others' (rows projected onto the simplex over"
                    " the other clients, r_ii = 0)",
    "lr_r_rule": "Coaching: 'lipschitz' (eta_r = 1/L_r per layer, the step of the paper's"
                 " Theorem 1; coach_lr_r unused) or 'fixed' (eta_r = coach_lr_r, the 0.01 of"
                 " the paper's set-up, which diverges on real models) or, a deviation,"
                 " 'exact' (R set to Eq. 10's minimiser at the current models: the limit of"
                 " many steps; squared f_s, no constraint)",
    "fs": "Coaching: the coaching loss f_s per layer, 'squared' (||s - w||^2) or 'norm'"
          " (||s - w||, the paper's 'l_2-norm' read literally; needs"
          " coach_lr_r_rule=fixed)",
}
# The flag names.
FLAG_NAMES = {"lam": "coach_lambda", "beta": "coach_beta", "lr_r": "coach_lr_r",
              "r_steps": "coach_r_steps", "r_init": "coach_r_init",
              "r_constraint": "coach_r_constraint", "lr_r_rule": "coach_lr_r_rule",
              "fs": "coach_fs"}


class CoachingServer(NamedTuple):
  relation: jax.Array  # [N, L, N] r_ij^l at [i, l, j]: client i's weight on client j


def validate(config: CoachingConfig) -> CoachingConfig:
  if config.lam < 0:
    raise FieldError("coaching", "lam", f"must be >= 0, got {config.lam}")
  if config.beta < 0:
    raise FieldError("coaching", "beta", f"must be >= 0, got {config.beta}")
  if config.lr_r < 0:
    raise FieldError("coaching", "lr_r", f"must be >= 0, got {config.lr_r}")
  if config.r_steps < 0:
    raise FieldError("coaching", "r_steps", f"must be >= 0, got {config.r_steps}")
  check_one_of("coaching", config, "r_init", R_INITS)
  check_one_of("coaching", config, "r_constraint", R_CONSTRAINTS)
  check_one_of("coaching", config, "lr_r_rule", LR_R_RULES)
  check_one_of("coaching", config, "fs", COACHING_LOSSES)
  if config.fs == "norm" and config.lr_r_rule != "fixed":
    raise FieldError("coaching", "lr_r_rule", "must be fixed with the norm f_s (fs=norm),"
                     " which is not smooth and so has no Lipschitz step 1/L_r nor a closed"
                     " form minimiser")
  if config.lr_r_rule == "exact" and config.r_constraint != "none":
    raise FieldError("coaching", "lr_r_rule", "exact (the unconstrained minimiser) needs"
                     " r_constraint=none")
  if config.lr_r_rule == "exact" and config.beta <= 0:
    raise FieldError("coaching", "lr_r_rule", "exact needs beta > 0 (a unique minimiser)")
  return config


def layer_grams(stacked: Params) -> jax.Array:
  """[L, N, N]: G_l = <w_a^l, w_b^l> for each layer l, input to output."""
  first = tree.first(stacked)
  return jnp.stack([tree.gram(stacked["params"][name])
                    for name in layer_names(first)])


def coaching_distances(relation: jax.Array, grams: jax.Array) -> jax.Array:
  """[N, L]: ||s_i^l - w_i^l||^2 from the Gram matrices (the square expanded; clipped at 0,
  which float32 rounding can cross where s_i^l = w_i^l)."""
  diag = jnp.diagonal(grams, axis1=1, axis2=2)                  # [L, N]: ||w_i^l||^2
  cross = jnp.einsum("ilj,lij->il", relation, grams)             # <w_i^l, s_i^l>
  quad = jnp.einsum("ilj,ljk,ilk->il", relation, grams, relation)  # ||s_i^l||^2
  return jnp.maximum(diag.T - 2.0 * cross + quad, 0.0)


# Inside the root of the norm f_s, in units of the layer's ||w_i^l||^2: the Gram
# expansion's float32 rounding (~1e-7 ||w_i^l||^2) is never divided by ~0 where s = w.
# It moves the norm by at most 0.1 % of ||w_i^l||.
NORM_GUARD = 1e-6


def layer_norms(relation: jax.Array, grams: jax.Array) -> jax.Array:
  """[N, L]: ||s_i^l - w_i^l||, guarded by NORM_GUARD."""
  diag = jnp.diagonal(grams, axis1=1, axis2=2).T
  return jnp.sqrt(coaching_distances(relation, grams) + NORM_GUARD * diag)


def relation_objective(relation: jax.Array, grams: jax.Array, lam: float,
                       beta: float, fs: str = "squared") -> jax.Array:
  """sum_i f(r_i) of Eq. (10): lam f_s(s_i^l, w_i^l) + beta/2 ||r_i - 1/N||^2, summed over
  clients and layers, f_s the squared distance or (fs="norm") the distance."""
  num_clients = relation.shape[0]
  coach_loss = (coaching_distances(relation, grams) if fs == "squared"
                else layer_norms(relation, grams))
  return (lam * jnp.sum(coach_loss)
          + 0.5 * beta * jnp.sum(jnp.square(relation - 1.0 / num_clients)))


def relation_gradient(relation: jax.Array, grams: jax.Array, lam: float,
                      beta: float, fs: str = "squared") -> jax.Array:
  """Eq. (11)-(12): lam grad f_s + beta (r_i - 1/N) for every client i, [N, L, N].
  grad_{r_ij^l} f_s is 2 <s_i^l - w_i^l, w_j^l> for the squared distance and
  <s_i^l - w_i^l, w_j^l> / ||s_i^l - w_i^l|| for the distance."""
  num_clients = relation.shape[0]
  target = jnp.einsum("lij->ilj", grams)                  # G_l[i, j] = <w_i^l, w_j^l>
  combined = jnp.einsum("ilk,lkj->ilj", relation, grams)  # <s_i^l, w_j^l>
  if fs == "squared":
    coach_grad = 2.0 * (combined - target)
  else:
    coach_grad = (combined - target) / layer_norms(relation, grams)[..., None]
  return lam * coach_grad + beta * (relation - 1.0 / num_clients)


def project_to_simplex(values: jax.Array, allowed: jax.Array) -> jax.Array:
  """Euclidean projection of each row [..., N] onto the simplex over `allowed` entries."""
  v = jnp.where(allowed, values, -1e9)
  u = -jnp.sort(-v, axis=-1)
  css = jnp.cumsum(u, axis=-1)
  k = jnp.arange(1, v.shape[-1] + 1, dtype=v.dtype)
  support = u - (css - 1.0) / k > 0
  count = jnp.sum(support, axis=-1, keepdims=True)
  tau = (jnp.take_along_axis(css, count.astype(jnp.int32) - 1, axis=-1) - 1.0) / count
  return jnp.where(allowed, jnp.maximum(v - tau, 0.0), 0.0)


def others_mask(num_clients: int) -> jax.Array:
  """[N, 1, N]: True where j != i."""
  return ~jnp.eye(num_clients, dtype=bool)[:, None, :]


def step_sizes(grams: jax.Array, config: CoachingConfig) -> jax.Array:
  """[L, 1]: eta_r for each layer's relation rows. "lipschitz": 1 / L_r with
  L_r = beta + 2 lam lambda_max(G_l), the smoothness constant of f(r_i^l) (its Hessian is
  2 lam G_l + beta I), the step Theorem 1 prescribes, taken per layer since the rows of
  different layers are independent problems."""
  if config.lr_r_rule == "fixed":
    return jnp.full((grams.shape[0], 1), config.lr_r, grams.dtype)
  top = linalg.eigvalsh(grams)[:, -1]
  return (1.0 / (config.beta + 2.0 * config.lam * jnp.maximum(top, 0.0)))[:, None]


def relation_step(relation: jax.Array, grams: jax.Array, config: CoachingConfig) -> jax.Array:
  """One step of Eq. (11) on every client's relation matrix (then the simplex_others
  projection, where that deviation is chosen)."""
  relation = relation - step_sizes(grams, config) * relation_gradient(
      relation, grams, config.lam, config.beta, config.fs)
  if config.r_constraint == "simplex_others":
    relation = project_to_simplex(relation, others_mask(relation.shape[0]))
  return relation


def relation_minimiser(grams: jax.Array, lam: float, beta: float) -> jax.Array:
  """[N, L, N]: each r_i^l at the minimum of Eq. (10) with f_s the squared distance,
  r_i^l = 1/N + (G_l + mu I)^-1 G_l (e_i - 1/N), mu = beta / (2 lam), from the
  eigendecomposition of G_l. The map sigma^2 -> sigma^2 / (sigma^2 + mu) changes by at
  most d / mu when an eigenvalue is off by d, so float32 rounding of G_l (~1e-7 of its
  largest eigenvalue) moves R by at most ~1e-7 lambda_max / mu: 0.035 for the largest
  layer of coaching_cnn trained on FMNIST (beta = 0.01); measured against float64 there,
  it moves far less (docs/coaching.md)."""
  num_clients = grams.shape[-1]
  values, vectors = linalg.eigh(grams)                            # [L, N], [L, N, N]
  values = jnp.maximum(values, 0.0)
  mu = beta / (2.0 * lam) if lam > 0 else jnp.inf
  shrink = values / (values + mu)
  # rows i of M_l = V diag(shrink) V^T applied to e_i - 1/N: M_l (I - 1/N)[:, i].
  centered = jnp.eye(num_clients) - 1.0 / num_clients
  moved = jnp.einsum("lab,lb,lcb,ci->ila", vectors, shrink, vectors, centered)
  return 1.0 / num_clients + moved


def update_relation(relation: jax.Array, grams: jax.Array, config: CoachingConfig) -> jax.Array:
  """Algorithm 1, lines 5-8: E_r = r_steps steps of Eq. (9)/(11) at fixed models (or,
  lr_r_rule="exact", the point those steps converge to)."""
  if config.lr_r_rule == "exact":
    return relation_minimiser(grams, config.lam, config.beta).astype(relation.dtype)
  return jax.lax.fori_loop(0, config.r_steps,
                           lambda _, r: relation_step(r, grams, config), relation)


def initial_relation(key: jax.Array, num_clients: int, num_layers: int,
                     config: CoachingConfig) -> jax.Array:
  """R^1 (Algorithm 1, line 2), [N, L, N]: rows uniform on the simplex ("random"), or 1/N.

  Under simplex_others the diagonal is dropped and rows renormalised: a Dirichlet(1) row
  with one entry removed and renormalised is Dirichlet(1) over the rest."""
  shape = (num_clients, num_layers, num_clients)
  if config.r_init == "random":
    relation = jax.random.dirichlet(key, jnp.ones((num_clients,)), shape[:2])
  else:
    relation = jnp.full(shape, 1.0 / num_clients)
  if config.r_constraint == "simplex_others":
    relation = jnp.where(others_mask(num_clients), relation, 0.0)
    relation = relation / jnp.sum(relation, axis=-1, keepdims=True)
  return relation


def coaching_models(relation: jax.Array, stacked: Params) -> Params:
  """Eq. (14): s_i^l = sum_j r_ij^l w_j^l, leaves [N, ...]."""
  first = tree.first(stacked)
  return {"params": {
      name: tree.mix(relation[:, l, :], stacked["params"][name])
      for l, name in enumerate(layer_names(first))}}


def coaching(config: CoachingConfig, trainer: ClientTrainer) -> Algorithm:
  config = validate(config)

  def init(context: InitContext) -> AlgorithmState:
    num_clients = tree.leading_size(context.params)
    if num_clients < 2:
      raise ConfigError("coaching needs at least 2 clients (each is coached by the others)")
    num_layers = len(layer_names(tree.first(context.params)))
    relation = initial_relation(context.key, num_clients, num_layers, config)
    # Round 1's R steps (Algorithm 1, lines 5-8) at the initial models.
    relation = update_relation(relation, layer_grams(context.params), config)
    return AlgorithmState(server=CoachingServer(relation=relation), clients=context.params)

  def broadcast(server: CoachingServer, client_params):
    return coaching_models(server.relation, client_params)

  def client_update(params, coach, data, key):
    def pull(p):  # lambda f_s(s_i, w_i), Eq. (15)
      if config.fs == "squared":  # the sum over layers of Eq. 5 is one squared distance
        return config.lam * tree.squared_distance(p, coach)
      # Eq. 5's sum over layers of ||s_i^l - w_i^l||; the 1e-12 keeps its gradient finite
      # (zero) where w_i^l = s_i^l, as in the first local step after an exact combination.
      return config.lam * sum(
          jnp.sqrt(tree.squared_distance(p["params"][name], coach["params"][name]) + 1e-12)
          for name in layer_names(p))
    params, stats = trainer.train(params, data.train, key, regularizer=pull)
    return ClientOutput(state=params, upload=(), train=stats)

  def aggregate(server: CoachingServer, client_params, uploads, weights):
    del uploads, weights
    # The next round's R steps, at the models just trained (W^{k+1}).
    relation = update_relation(server.relation, layer_grams(client_params), config)
    return AlgorithmState(server=CoachingServer(relation=relation), clients=client_params)

  return Algorithm(name="coaching", init=init, broadcast=broadcast,
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: clients,
                   # The server's R steps and coaching models read the uploaded models.
                   state_upload=lambda params: params,
                   artifacts=lambda server: {"relation_cube": server.relation})
