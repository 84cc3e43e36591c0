"""ConFREE: conflict-free aggregation of client updates, as a plug-in for the server step
of any algorithm with a shared part (--aggregation=confree).

Zheng, Hu, Yang, Zheng, Xu, Wang. "ConFREE: Conflict-free Client Update Aggregation for
Personalized Federated Learning." AAAI 2025 (39(21): 22875-22883).
https://doi.org/10.1609/aaai.v39i21.34449  (code: github.com/StuZheng/ConFREE, ConFREE.py,
built on PFLlib; equation numbers are the poster's, ../shared/papers/confree_poster.txt)

Each client's update g_i of the shared part is projected off the updates it conflicts with
(`projection_order` "sequential"); the server takes their uniform mean g0, then the step
within c ||g0|| of g0 that most improves the worst client (`c` 0.4, CAGrad's), whose dual
on the simplex over the round's clients it solves by FISTA (`solver_steps` 300).

Departures: the dual by FISTA, not SLSQP; a fixed projection order, not shuffled. Options
for the authors' code: projection="code", granularity="leaf", rescale=True;
projection_order="eq3" is Eq. 3 as printed.

Details (every option, the departures, measurements): docs/algorithms/confree.md.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.algorithms.base import Algorithm, AlgorithmState
from fedora_jax.algorithms.plugin_fields import SharedPart
from fedora_jax.errors import ConfigError, FieldError

_TINY = 1e-12
PyTree = Any


class ConfreeConfig(NamedTuple):
  c: float = 0.4              # the poster's c: ||d - g0|| <= c ||g0|| (authors' co_alpha)
  projection_order: str = "sequential"  # "sequential" (PCGrad, authors' code) or "eq3"
  projection: str = "paper"   # "paper": project onto the normal plane; "code": authors' code
  granularity: str = "model"  # "model": one vector; "leaf": per parameter tensor (code)
  rescale: bool = False       # divide d* by 1 + c^2 (authors' code)
  solver_steps: int = 300     # accelerated projected-gradient steps for w* (Eq. 5)


FLAG_HELP = {
    "c": "ConFREE: the poster's c (Eq. 4-5), d* stays within c ||g0|| of the guidance"
         " vector g0 (the authors' co_alpha); the poster and the authors' code give no"
         " value, 0.4 is CAGrad's c",
    "projection_order": "ConFREE: sequential (one conflicting update at a time, against"
                        " the partially projected update: PCGrad, the authors' code) or"
                        " eq3 (Eq. 3 as printed: every term from the original update)",
    "projection": "ConFREE: paper (project onto the normal plane of a conflicting update)"
                  " or code (the authors' unnormalised subtraction)",
    "granularity": "ConFREE: model (one vector of all shared parameters) or leaf (each"
                   " parameter tensor on its own, as the authors' code)",
    "rescale": "ConFREE: divide d* by 1 + c^2 (authors' code)",
    "solver_steps": "ConFREE: accelerated projected-gradient steps for the simplex weights"
                    " w* (Eq. 5)",
}


def validate(config: ConfreeConfig) -> ConfreeConfig:
  if config.c < 0:
    raise FieldError("confree", "c", f"must be >= 0, got {config.c}")
  if config.projection_order not in ("sequential", "eq3"):
    raise FieldError("confree", "projection_order", "must be sequential or eq3, got"
                                                    f" {config.projection_order!r}")
  if config.projection not in ("paper", "code"):
    raise FieldError("confree", "projection", f"must be paper or code, got {config.projection!r}")
  if config.granularity not in ("model", "leaf"):
    raise FieldError("confree", "granularity", f"must be model or leaf, got {config.granularity!r}")
  if config.solver_steps < 1:
    raise FieldError("confree", "solver_steps", f"must be >= 1, got {config.solver_steps}")
  return config


def _all(updates: jax.Array) -> jax.Array:
  return jnp.ones(updates.shape[0], bool)


def project_conflicts(updates: jax.Array, sampled: jax.Array | None = None,
                      projection: str = "paper", order: str = "sequential") -> jax.Array:
  """[K, d] -> [K, d]: each sampled g_i projected away from every other sampled g_j it
  conflicts with (rows outside `sampled` [K] bool come back zero)."""
  sampled = _all(updates) if sampled is None else sampled
  num = updates.shape[0]
  squared_norms = jnp.sum(jnp.square(updates), axis=1)
  divisor = jnp.maximum(squared_norms, _TINY) if projection == "paper" else jnp.ones(num)
  if order == "eq3":
    dots = updates @ updates.T                                  # original g_i . g_j
    conflict = (dots < 0) & ~jnp.eye(num, dtype=bool) & sampled[None, :]
    projected = updates - jnp.where(conflict, dots / divisor[None, :], 0.0) @ updates
  else:
    def away_from(j, projected):
      g_j = updates[j]
      dots = projected @ g_j                                   # partially projected g_i'
      conflict = (dots < 0) & (jnp.arange(num) != j) & sampled[j]
      return projected - jnp.where(conflict, dots / divisor[j], 0.0)[:, None] * g_j[None]
    projected = jax.lax.fori_loop(0, num, away_from, updates)
  return jnp.where(sampled[:, None], projected, 0.0)


def guidance_vector(updates: jax.Array, sampled: jax.Array | None = None,
                    projection: str = "paper", order: str = "sequential") -> jax.Array:
  """Eq. (3): g0, the mean over the sampled clients of their conflict-free updates."""
  sampled = _all(updates) if sampled is None else sampled
  projected = project_conflicts(updates, sampled, projection, order)
  return jnp.sum(projected, axis=0) / jnp.maximum(jnp.sum(sampled), 1)


def dual_objective(w: jax.Array, gram: jax.Array, g_dot_g0: jax.Array,
                   radius: jax.Array) -> jax.Array:
  """Eq. (5)'s objective: g_w . g0 + radius ||g_w||, from Gram quantities."""
  return w @ g_dot_g0 + radius * jnp.sqrt(jnp.maximum(w @ gram @ w, 0.0))


def project_to_simplex(v: jax.Array, support: jax.Array) -> jax.Array:
  """Euclidean projection of v [K] onto {w >= 0, sum w = 1, w = 0 outside support}."""
  num = v.shape[0]
  descending = -jnp.sort(-jnp.where(support, v, -jnp.inf))
  inside = jnp.isfinite(descending)
  partial_sums = jnp.cumsum(jnp.where(inside, descending, 0.0))
  counts = jnp.arange(1, num + 1, dtype=v.dtype)
  positive = inside & (descending - (partial_sums - 1.0) / counts > 0)
  rho = jnp.max(jnp.where(positive, jnp.arange(1, num + 1), 1))
  shift = (partial_sums[rho - 1] - 1.0) / rho
  return jnp.where(support, jnp.maximum(v - shift, 0.0), 0.0)


def simplex_weights(gram: jax.Array, g_dot_g0: jax.Array, radius: jax.Array,
                    sampled: jax.Array | None = None, steps: int = 300) -> jax.Array:
  """Eq. (5): argmin over the simplex on `sampled` of w.(G g0) + radius ||G^T w||, by
  FISTA with backtracking and restarts. The objective's curvature grows as g_w nears 0;
  the backtracking finds the step it allows."""
  num = gram.shape[0]
  sampled = jnp.ones(num, bool) if sampled is None else sampled
  count = jnp.maximum(jnp.sum(sampled), 1)
  scale = jnp.maximum(jnp.trace(jnp.where(sampled[:, None], gram, 0.0)) / count, _TINY)
  gram, g_dot_g0, radius = gram / scale, g_dot_g0 / scale, radius / jnp.sqrt(scale)
  objective = lambda w: w @ g_dot_g0 + radius * jnp.sqrt(w @ gram @ w + _TINY)
  gradient = jax.grad(objective)

  def step(_, carry):
    w, y, t, lipschitz = carry
    g_y = gradient(y)
    trial = lambda lip: project_to_simplex(y - g_y / lip, sampled)

    # The step 1/L is safe when f(z) <= f(y) + g_y.(z - y) + L/2 ||z - y||^2. By
    # convexity f(z) - f(y) - g_y.(z - y) <= (g_z - g_y).(z - y): testing that instead
    # is sufficient and free of the cancellation in f(z) - f(y) near the optimum.
    def too_long(lip):
      z = trial(lip)
      curvature = (gradient(z) - g_y) @ (z - y)
      return (curvature > 0.5 * lip * jnp.sum(jnp.square(z - y))) & (lip < 1e12)

    lipschitz = jax.lax.while_loop(too_long, lambda lip: 2.0 * lip, lipschitz)
    z = trial(lipschitz)
    # Restart the momentum when it points uphill (the gradient test, robust to round-off
    # in f near the optimum).
    restart = (y - z) @ (z - w) > 0
    t_next = (1.0 + jnp.sqrt(1.0 + 4.0 * t * t)) / 2.0
    y = jnp.where(restart, z, z + (t - 1.0) / t_next * (z - w))
    t_next = jnp.where(restart, 1.0, t_next)
    return z, y, t_next, 0.9 * lipschitz  # let the step grow back where f is flatter

  start = jnp.where(sampled, 1.0 / count, 0.0).astype(gram.dtype)
  one = jnp.ones((), gram.dtype)
  return jax.lax.fori_loop(0, steps, step, (start, start, one, one))[0]


def conflict_free_step(updates: jax.Array, config: ConfreeConfig,
                       sampled: jax.Array | None = None):
  """[K, d] updates, [K] bool sampled -> (d* [d], g0 [d], w* [K]): Eq. (3)-(5) over the
  sampled clients' updates."""
  sampled = _all(updates) if sampled is None else sampled
  updates = jnp.where(sampled[:, None], updates, 0.0)
  g0 = guidance_vector(updates, sampled, config.projection, config.projection_order)
  radius = config.c * jnp.linalg.norm(g0)
  weights = simplex_weights(updates @ updates.T, updates @ g0, radius, sampled,
                            config.solver_steps)
  g_w = weights @ updates
  direction = g0 + radius / jnp.maximum(jnp.linalg.norm(g_w), _TINY) * g_w
  if config.rescale:
    direction = direction / (1.0 + config.c ** 2)
  return direction, g0, weights


def aggregate_updates(updates, config: ConfreeConfig, sampled: jax.Array | None = None):
  """ConFREE's step d* for a pytree of stacked updates (leaves [K, ...]) of which only
  the `sampled` [K] clients' count."""
  leaves, treedef = jax.tree.flatten(updates)
  num = leaves[0].shape[0]
  flat = [leaf.reshape(num, -1) for leaf in leaves]
  if config.granularity == "leaf":
    steps = [conflict_free_step(f, config, sampled)[0] for f in flat]
  else:
    whole = conflict_free_step(jnp.concatenate(flat, axis=1), config, sampled)[0]
    ends = np.cumsum([f.shape[1] for f in flat])[:-1].tolist()  # static split points
    steps = jnp.split(whole, ends) if ends else [whole]
  return jax.tree.unflatten(treedef, [s.reshape(leaf.shape[1:]) for s, leaf in
                                      zip(steps, leaves)])


def with_confree(host: Algorithm, config: ConfreeConfig, name: str | None = None) -> Algorithm:
  """The host with theta_g, its server's shared parameters (where its `shared_part`
  says), moved by ConFREE's d* instead of the mean.

  The host's own aggregate still runs (for anything else it keeps); its new theta_g is
  then replaced by the old one plus d*, computed from the old one and the uploaded
  copies.
  """
  config = validate(config)
  shared: SharedPart | None = host.shared_part
  if shared is None:
    raise ConfigError(f"--aggregation=confree needs an algorithm whose server averages a"
                      f" shared part; {host.name} declares none (Algorithm.shared_part)")

  def aggregate(server, clients, uploads, weights):
    state = host.aggregate(server, clients, uploads, weights)
    theta_g, uploaded = shared.of_server(server), shared.of_uploads(uploads)
    if jax.tree.structure(theta_g) != jax.tree.structure(uploaded):
      raise ConfigError(f"--aggregation=confree: {host.name}'s server state is not the"
                        " shared model its clients upload")
    updates = jax.tree.map(lambda upload, g: upload - g[None], uploaded, theta_g)
    # Clients that sat the round out carry weight 0 (and no real upload): they don't count.
    step = aggregate_updates(updates, config, sampled=weights > 0)
    moved = jax.tree.map(jnp.add, theta_g, step)
    return AlgorithmState(server=shared.replace(state.server, moved), clients=state.clients)

  # Its projections run over the uploads one client at a time, in client order.
  return host._replace(name=name or f"{host.name}+confree", aggregate=aggregate,
                       uploads_unordered=False)
