"""Knowledge-aware parameter coaching: each client's training is pulled towards a
layer-wise combination of all clients' parameters, the combination weights (the
relation cube) being learned by the server.

Zhi, Bi, Xu, Wang, Xiang. "Knowledge-Aware Parameter Coaching for Personalized Federated
Learning." AAAI 2024 (Proceedings of the AAAI Conference on Artificial Intelligence
38(15), pp. 17069-17077). Equation numbers below are the paper's. No public code of the
paper was available to us.

Notation: N clients, L layers (fedora_jax.algorithms.layers: flax top-level modules, a
Dense layer's kernel and bias together, input to output), w_j^l client j's parameters of
layer l. The relation cube R [N, L, N] (Eq. 3-4) holds r_ij^l, client i's weight on
client j at layer l, for every j including i itself.

  Client objective (Eq. 5): f_i(w_i) + lambda sum_l f_s(sum_j r_ij^l w_j^l, w_i^l)
                            + beta/2 sum_{j,l} (r_ij^l - 1/N)^2,
  with f_s the coaching loss, for which the paper "adopts l_2-norm". We read it as the
  squared distance f_s(a, b) = ||a - b||^2: only then is Eq. 6 (one f_s of the stacked
  layers) equal to Eq. 5 (a sum of f_s over layers), and H is L-smooth as Assumption 2
  requires. The word read literally, f_s(a, b) = ||a - b|| per layer, is fs="norm"
  (below): R's gradient is then <s_i^l - w_i^l, w_j^l> / ||s_i^l - w_i^l||, bounded by
  ||w_j^l||, and the client's pull lambda (w_i^l - s_i^l) / ||w_i^l - s_i^l|| is a unit
  vector per layer, so the set-up's eta_r = 0.01 cannot blow up as it does on the square.
  Relation update (Eq. 10-12), with the clients' parameters W^k fixed, per client i:
        r_i <- r_i - eta_r (lambda grad_{r_i} f_s(r_i W^k, w_i^k) + beta (r_i - 1/N)),
        grad_{r_ij^l} f_s = 2 <s_i^l - w_i^l, w_j^l> = 2 (sum_k r_ik^l G_l[k, j] - G_l[i, j])
  from the per-layer Gram matrices G_l[a, b] = <w_a^l, w_b^l> (so nothing larger than
  [N, N] per layer is built). A plain gradient step: R is not constrained (rows need not
  be non-negative nor sum to 1), and r_ii is learned like any other entry. Eq. 11 is
  taken per client without the m_i/m of Eq. 8's G(R) and H (Eq. 10 drops them).
  Coaching model (Eq. 14):  s_i^l = sum_j r_ij^l w_j^l.
  Client update (Eq. 15-16): client i trains its own w_i, from where it stopped, with the
        run's local SGD (E epochs) on  f_i(w_i) + lambda ||w_i - s_i||^2.
The order is Algorithm 1's: each round the server first takes E_r (`r_steps`) gradient
steps on R at the clients' current models W^k (lines 5-8), then sends s_i = r_i W^k
(lines 9-10). Here the steps of round k+1 are taken at the end of round k (in
`aggregate`, at the models just trained), and those of round 1 in `init` at the initial
models, which is the same sequence. R starts random (Algorithm 1, line 2; the paper
gives no distribution: each row r_i^l is drawn uniformly from the probability simplex,
Dirichlet(1, ..., 1), so that every s_i starts as a convex combination of models of the
clients' scale). A client's personalised model is its own w_i (line 14).

Under client selection (--participation < 1, the paper's Table 2) the engine trains the
round's sampled clients only (rounds.py); the others keep their w_i, which s_i and R's
step read as part of W^k ("the parameters of all clients in the server", after Eq. 14).
R's step covers every row each round (Eq. 9's whole cube); Algorithm 1's loop over
clients, read for selection, would step only the sampled clients' rows. With the default
step R barely moves in a round there, so the two readings nearly agree (measured:
docs/coaching.md, "Under client selection", with the reason coaching trails LOCAL there).

Defaults are the paper's where it states them: E_r = 1 ("the local epochs for W and R
are set to 5 and 1 ... the learning rates for W and R are both set to 0.01"; E and the
client learning rate are the run's --local_epochs and --lr). For eta_r the paper states
two things that disagree: 0.01 in its set-up and 1/L_r in its Theorem 1. The default is
Theorem 1's (lr_r_rule="lipschitz", below), because 0.01 diverges on real models;
lr_r_rule="fixed" with lr_r = 0.01 is the set-up's value. It does not
state the lambda and beta behind its Tables 1-2; its Figure 3 sweeps lambda around 1
(with beta / (2 lambda) = 0.005 at Dirichlet alpha 0.1 and 0.5 at alpha 0.3) and beta
around 0.01 (alpha 0.1) and 1 (alpha 0.3) at lambda = 1. Defaults: lambda = 1 and
beta = 0.01, the centre of its alpha = 0.1 sweeps; use beta = 1 for alpha = 0.3.

The step size, and the deviations (off by default), behind config fields:
  * r_constraint="simplex_others": after each step, project every row r_i^l onto the
    probability simplex over the OTHER clients (r_ij^l >= 0, sum_{j != i} r_ij^l = 1,
    r_ii^l = 0), so that s_i is a convex combination of the others' models. Not in the
    paper; it was this module's earlier behaviour. On that simplex the paper's
    beta/2 ||r - 1/N||^2 and a ridge beta/2 ||r||^2 give the same projected steps.
  * r_init="uniform": R starts at 1/N everywhere (the regulariser's target; 1/(N-1) over
    the others under simplex_others) instead of randomly.
  * lr_r_rule="lipschitz" (default): eta_r = 1 / L_r with L_r = beta + 2 lambda
    lambda_max(G_l), per layer, recomputed at every step: the step the paper's Theorem 1
    assumes ("eta_r = 1/L_r"); "fixed" takes the 0.01 its experiments state. The two disagree on
    real models: all clients start from one model, so G_l is close to ||w^l||^2 times the
    all-ones matrix and f(r_i^l) has curvature ~2 lambda N ||w^l||^2 along the all-ones
    direction (the rows' sum); with ||w^l||^2 in the tens (a 784x128 dense layer at
    PyTorch's initialisation: ~43) and N = 10 that is ~10^3, far past 2 / 0.01. The fixed
    step then multiplies any error in a row's sum by |1 - 0.01 L_r| (~8) every round
    until R and the losses are NaN (measured: docs/coaching.md). The lipschitz step
    stays stable.
  * lr_r_rule="exact": R set each round to Eq. 10's minimiser at the current models
    (closed form for the squared f_s: relation_minimiser), the point E_r -> infinity
    steps converge to; block coordinate descent with an exact R block. A deviation: it
    asks what a learned R gives, where one step of 1/L_r leaves R at its random start.
  * fs="norm": f_s the l_2 norm itself, not its square (see f_s above); it is not smooth
    at s = w, so it has no L_r and runs with lr_r_rule="fixed" (the set-up's 0.01).
The earlier defaults (r_steps = 10, lambda = 0.5, a ridge penalty beta ||R||^2 with beta
= 1, R uniform over the others) are  r_constraint="simplex_others", r_init="uniform",
r_steps=10, lam=0.5, beta=2.

The relation cube is saved with the results (relation_cube.npy) and drawn, as the paper's
Figure 2, for one client (plots.py, relation.png).
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
  # models, see the module docstring.
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
