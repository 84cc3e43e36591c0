"""How much a client's data leaks: gradient inversion of its first-round update, and
membership inference against the models it ends with.

Gradient inversion. The server (or an eavesdropper) sees one client's first-round update
Delta = theta_1 - theta_0 of one local SGD step on a batch of B samples (FedSGD's upload;
no momentum, no weight decay), so it knows the batch's mean gradient g = -Delta / lr at
theta_0. It then looks for a dummy batch (x', y') whose gradient matches:

  * DLG (Zhu, Liu, Han. "Deep Leakage from Gradients." NeurIPS 2019): minimise
    ||grad_theta L(theta_0; x', softmax(y')) - g||^2 over the images x' and the label
    logits y' together, by L-BFGS from a random start (the paper's optimiser);
  * iDLG (Zhao, Mopuri, Bilen. "iDLG: Improved Deep Leakage from Gradients." 2020): at
    B = 1 the label is read off the gradient first, the one class whose output-layer bias
    gradient softmax(z) - onehot(y) is negative, and only x' is optimised.

Reconstructions are scored against the true images in [0, 1] by PSNR and SSIM, each
reconstruction paired with the true image it is nearest (B > 1: the order of a batch is
lost in its mean gradient; the pairing is the assignment of least total squared error).

Membership inference by a loss threshold (Yeom, Giacomelli, Fredrikson, Jha. "Privacy
Risk in Machine Learning: Analyzing the Connection to Overfitting." CSF 2018): a sample
is called a member of a client's training set when the model's loss on it is low. Its
AUC over the client's training samples (members) against its test samples (non-members,
the same distribution) is 0.5 when the model leaks nothing of who trained it, 1 when its
losses separate the two completely.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import ndimage, optimize

from fedora_jax.data.client_data import ClientData
from fedora_jax.engine.local_training import make_client_trainer, make_optimizer
from fedora_jax.errors import ConfigError

PyTree = Any
Apply = Callable[[PyTree, jax.Array], jax.Array]


def fedsgd_update(apply: Apply, params: PyTree, x: jax.Array, y: jax.Array,
                  lr: float) -> PyTree:
  """theta_1 - theta_0: one local SGD step (no momentum, no weight decay) on the batch
  (x [B, ...], y [B]), by the engine's client trainer, as the client would send it."""
  batch = x.shape[0]
  trainer = make_client_trainer(apply, make_optimizer(lr, 0.0, 0.0), epochs=1,
                                batch_size=batch)
  data = ClientData(x=x, y=y, mask=jnp.ones(batch, bool), n=jnp.int32(batch))
  trained = trainer.train(params, data, jax.random.key(0))[0]
  return jax.tree.map(jnp.subtract, trained, params)


def gradient_from_update(update: PyTree, lr: float) -> PyTree:
  """The batch's mean gradient an SGD step's update reveals: -update / lr."""
  return jax.tree.map(lambda u: -u / lr, update)


def soft_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean over the batch of -sum_c targets_c log softmax(logits)_c."""
  return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))


def output_bias(tree: PyTree, num_classes: int) -> jax.Array:
  """The output layer's bias in a model's (or a gradient's) tree: its one `bias` leaf of
  shape [num_classes]."""
  found = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
           if str(getattr(path[-1], "key", "")) == "bias" and leaf.shape == (num_classes,)]
  if len(found) != 1:
    raise ConfigError(f"iDLG reads the output layer's bias gradient; this model has"
                      f" {len(found)} bias vectors of {num_classes} entries")
  return found[0]


def idlg_label(gradient: PyTree, num_classes: int) -> jax.Array:
  """iDLG's label of a one-sample gradient: the class whose output-bias gradient
  softmax(z) - onehot(y) is negative (its smallest entry)."""
  return jnp.argmin(output_bias(gradient, num_classes))


class Inversion(NamedTuple):
  images: jax.Array      # [B, ...] the reconstruction, clipped to [0, 1]
  labels: jax.Array      # [B] its labels (argmax of the optimised logits, or iDLG's)
  match: jax.Array       # [] the final gradient distance


def gradient_distance(apply: Apply, params: PyTree, target: PyTree, images: jax.Array,
                      label_probs: jax.Array) -> jax.Array:
  """||grad_theta L(theta; images, label_probs) - target||^2 over every leaf."""
  grads = jax.grad(lambda p: soft_cross_entropy(apply(p, images), label_probs))(params)
  return jnp.asarray(sum(jnp.sum(jnp.square(g - t)) for g, t in
                         zip(jax.tree.leaves(grads), jax.tree.leaves(target))))


def invert_gradient(apply: Apply, params: PyTree, target: PyTree, image_shape: tuple,
                    batch: int, num_classes: int, key: jax.Array, steps: int = 300,
                    labels: jax.Array | None = None) -> Inversion:
  """DLG (labels None: the label logits optimised with the images) or, given `labels`
  [B], iDLG's images-only search; L-BFGS for `steps` steps from uniform random images
  and normal label logits."""
  image_key, label_key = jax.random.split(key)
  start = {"images": jax.random.uniform(image_key, (batch, *image_shape)),
           "logits": jax.random.normal(label_key, (batch, num_classes))}
  fixed = None if labels is None else jax.nn.one_hot(labels, num_classes)

  def objective(dummy):
    probs = jax.nn.softmax(dummy["logits"]) if fixed is None else fixed
    return gradient_distance(apply, params, target, dummy["images"], probs)

  solver = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(objective)

  def step(carry, _):
    dummy, state = carry
    value, grad = value_and_grad(dummy, state=state)
    updates, state = solver.update(grad, state, dummy, value=value, grad=grad,
                                   value_fn=objective)
    return (optax.apply_updates(dummy, updates), state), None

  (dummy, _), _ = jax.lax.scan(step, (start, solver.init(start)), None, length=steps)
  found = dummy["logits"].argmax(-1) if labels is None else labels
  return Inversion(images=jnp.clip(dummy["images"], 0.0, 1.0), labels=found,
                   match=objective(dummy))


def psnr(original: np.ndarray, reconstruction: np.ndarray) -> float:
  """10 log10(1 / MSE) for images in [0, 1] (inf for identical ones)."""
  mse = float(np.mean(np.square(np.asarray(original, np.float64) -
                                np.asarray(reconstruction, np.float64))))
  return float("inf") if mse == 0 else 10.0 * np.log10(1.0 / mse)


def ssim(original: np.ndarray, reconstruction: np.ndarray, sigma: float = 1.5) -> float:
  """The mean structural similarity of two 2-D images in [0, 1] (Wang, Bovik, Sheikh,
  Simoncelli 2004): Gaussian-weighted local means, variances and covariance (sigma 1.5,
  window radius 5), C1 = 0.01^2, C2 = 0.03^2."""
  a, b = (np.asarray(v, np.float64).reshape(np.asarray(v).shape[:2]) for v in
          (original, reconstruction))

  def blur(v):
    return ndimage.gaussian_filter(v, sigma, truncate=3.5, mode="reflect")
  mu_a, mu_b = blur(a), blur(b)
  var_a = blur(a * a) - mu_a ** 2
  var_b = blur(b * b) - mu_b ** 2
  cov = blur(a * b) - mu_a * mu_b
  c1, c2 = 0.01 ** 2, 0.03 ** 2
  index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2) /
           ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2)))
  return float(np.mean(index))


def pair_reconstructions(originals: np.ndarray, reconstructions: np.ndarray) -> np.ndarray:
  """The reconstruction for each original: the assignment of least total squared error
  (a batch's mean gradient does not keep its order)."""
  flat_o = np.asarray(originals, np.float64).reshape(len(originals), -1)
  flat_r = np.asarray(reconstructions, np.float64).reshape(len(reconstructions), -1)
  cost = np.square(flat_o[:, None] - flat_r[None]).mean(-1)
  _, columns = optimize.linear_sum_assignment(cost)
  return columns


def per_sample_losses(apply: Apply, params: PyTree, data: ClientData) -> np.ndarray:
  """One model's cross-entropy on each of a client's real samples ([n])."""
  logits = apply(params, jnp.asarray(data.x))
  labels = jnp.asarray(data.y)[:, None]
  losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels, axis=-1)[:, 0]
  return np.asarray(losses)[np.asarray(data.mask)]


def membership_auc(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> float:
  """The loss-threshold attack's AUC: P(loss of a member < loss of a non-member), ties
  counting a half (the Mann-Whitney statistic)."""
  members = np.asarray(member_losses, np.float64)[:, None]
  others = np.asarray(nonmember_losses, np.float64)[None, :]
  return float(np.mean((members < others) + 0.5 * (members == others)))
