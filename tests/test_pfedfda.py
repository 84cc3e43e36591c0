"""pFedFDA: the LDA head, the priors and the client's Gaussians against hand values, the
stratified folds, the cross-validation loss against a numpy brute force, the betas it
picks, and bad values refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax.algorithms import pfedfda
from fedora_jax.algorithms.pfedfda import Gaussians, PfedFdaConfig
from fedora_jax.errors import ConfigError
from tiny import tiny_model, tiny_trainer


def test_lda_head_by_hand():
  gaussians = Gaussians(means=jnp.array([[1.0, 0.0], [0.0, 2.0]]),
                        cov=jnp.diag(jnp.array([2.0, 4.0])))
  head = pfedfda.lda_head(gaussians, jnp.array([0.25, 0.75]), eps=0.5)
  # Shrunk: 0.5 diag(2, 4) + 0.5 * tr 6 / 2 I = diag(2.5, 3.5); W = S^-1 mu^T.
  np.testing.assert_allclose(head["kernel"], [[0.4, 0.0], [0.0, 2.0 / 3.5]], rtol=1e-6)
  np.testing.assert_allclose(head["bias"], [-0.2 + np.log(0.25), -4.0 / 7.0 + np.log(0.75)],
                             rtol=1e-6)


def test_priors_and_local_gaussians_by_hand():
  y = jnp.array([0, 0, 0, 1, 2])
  mask = jnp.array([True, True, True, True, False])   # the last is padding
  priors = pfedfda.priors_of(y, mask, 3, eps=0.1)
  shares = np.array([0.75, 0.25, 0.0]) + 0.1
  np.testing.assert_allclose(priors, shares / shares.sum(), rtol=1e-6)
  z = jnp.array([[1.0, 0.0], [3.0, 0.0], [2.0, 3.0], [5.0, 5.0], [9.0, 9.0]])
  fallback = jnp.array([[0.0, 0.0], [4.0, 4.0], [7.0, 7.0]])
  local = pfedfda.local_gaussians(z, y, mask, fallback, min_count=2, eps=0.5)
  # Class 0 (3 > 2 samples) its mean (2, 1); class 1 (one sample) and 2 (none) fall back.
  np.testing.assert_allclose(local.means, [[2.0, 1.0], [4.0, 4.0], [7.0, 7.0]], rtol=1e-6)
  # Centred: (-1, -1), (1, -1), (0, 2) and (1, 1) against class 1's fallback mean.
  scatter = np.array([[1 + 1 + 0 + 1, 1 - 1 + 0 + 1], [1 - 1 + 0 + 1, 1 + 1 + 4 + 1]])
  np.testing.assert_allclose(local.cov, scatter / 3.0 + 0.5 + np.eye(2), rtol=1e-6)


def test_folds_are_stratified():
  y = jnp.array([0, 0, 0, 0, 1, 1, 1, 2, 0])
  mask = jnp.array([True] * 8 + [False])
  fold = np.asarray(pfedfda.fold_of(y, mask, 3, 2, jax.random.key(3)))
  assert fold[7] == -1 and fold[8] == -1       # class 2 has one sample; padding
  assert sorted(fold[:4]) == [0, 0, 1, 1]      # class 0's four dealt two and two
  assert sorted(fold[4:7]) in ([0, 0, 1], [0, 1, 1])


def _lda_logits_np(z, means, cov, priors, eps):
  dim = cov.shape[0]
  shrunk = (1 - eps) * cov + eps * np.trace(cov) / dim * np.eye(dim)
  kernel = np.linalg.inv(shrunk) @ means.T
  return z @ kernel - 0.5 * np.sum(means * kernel.T, -1) + np.log(priors)


def _cv_losses_np(z, y, fold, global_means, global_cov, priors, betas, folds, eps):
  """The summed fold-mean cross-entropy at each (beta_mu, beta_Sigma), by brute force."""
  out = np.zeros((len(betas), len(betas)))
  for f in range(folds):
    train, test = (fold >= 0) & (fold != f), fold == f
    means = global_means.copy()
    for c in range(global_means.shape[0]):
      if np.sum(train & (y == c)) > folds:
        means[c] = z[train & (y == c)].mean(0)
    centred = z[train] - means[y[train]]
    cov = centred.T @ centred / (train.sum() - 1) + eps + np.eye(z.shape[1])
    for i, bm in enumerate(betas):
      for j, bc in enumerate(betas):
        logits = _lda_logits_np(z[test], bm * means + (1 - bm) * global_means,
                                bc * cov + (1 - bc) * global_cov, priors, eps)
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        out[i, j] += -np.mean(logp[np.arange(test.sum()), y[test]])
  return out


def test_cross_validation_against_numpy():
  rng = np.random.default_rng(0)
  y = np.array([0] * 7 + [1] * 6 + [2] * 1)
  z = (rng.normal(size=(14, 3)) + 2.0 * np.eye(3)[y]).astype(np.float64)
  mask = np.ones(14, bool)
  fold = np.asarray(pfedfda.fold_of(jnp.asarray(y), jnp.asarray(mask), 3, 2,
                                    jax.random.key(1)))
  global_means = rng.uniform(size=(3, 3))
  global_cov = np.eye(3) * 1.5
  priors = np.asarray(pfedfda.priors_of(jnp.asarray(y), jnp.asarray(mask), 3, 1e-4))
  betas = np.linspace(0, 1, 3)
  got = pfedfda.cv_losses(jnp.asarray(z, jnp.float32), jnp.asarray(y), jnp.asarray(fold),
                          Gaussians(jnp.asarray(global_means, jnp.float32),
                                    jnp.asarray(global_cov, jnp.float32)),
                          jnp.asarray(priors), jnp.asarray(betas, jnp.float32), 2, 1e-4)
  want = _cv_losses_np(z, y, fold, global_means, global_cov, priors, betas, 2, 1e-4)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  # choose_betas picks the grid's minimum, the diagonal's for one beta.
  args = (jnp.asarray(z, jnp.float32), jnp.asarray(y), jnp.asarray(mask),
          Gaussians(jnp.asarray(global_means, jnp.float32), jnp.asarray(global_cov,
                                                                        jnp.float32)),
          jnp.asarray(priors), jax.random.key(1))
  i, j = np.unravel_index(np.argmin(want), want.shape)
  chosen = pfedfda.choose_betas(PfedFdaConfig(grid=3), *args)
  np.testing.assert_allclose(chosen, (betas[i], betas[j]))
  k = np.argmin(np.diagonal(want))
  chosen = pfedfda.choose_betas(PfedFdaConfig(grid=3, betas="single"), *args)
  np.testing.assert_allclose(chosen, (betas[k], betas[k]))
  np.testing.assert_allclose(pfedfda.choose_betas(PfedFdaConfig(betas="local"), *args),
                             (1.0, 1.0))


def test_no_class_with_enough_samples_uses_the_global_gaussians():
  z = jnp.ones((3, 2))
  y = jnp.array([0, 1, 2])
  gaussians = Gaussians(jnp.zeros((3, 2)), jnp.eye(2))
  chosen = pfedfda.choose_betas(PfedFdaConfig(), z, y, jnp.ones(3, bool), gaussians,
                                jnp.ones(3) / 3, jax.random.key(0))
  np.testing.assert_allclose(chosen, (0.0, 0.0))


@pytest.mark.parametrize("field,value", [("betas", "three"), ("folds", 1), ("grid", 1),
                                         ("eps", 0.0)])
def test_bad_values_refused(field, value):
  with pytest.raises(ConfigError, match=field):
    pfedfda.pfedfda(PfedFdaConfig(**{field: value}), tiny_trainer(tiny_model()))
