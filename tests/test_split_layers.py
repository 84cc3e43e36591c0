"""Layers of every registered model in forward order, the body / head split, and
LG-FedAvg and FedPer: which layers are shared (averaged) and which stay on the client."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import tree
from fedora_jax.algorithms import fedper, layers, lg_fedavg
from fedora_jax.algorithms.base import InitContext
from fedora_jax.rounds import RoundState, build_train_round
from fedora_jax.errors import ConfigError
from fedora_jax.models import MODELS, build_model
from tiny import init_params, mean_ce, tiny_data, tiny_model, tiny_trainer

LR = 0.1
SIZES = [3, 6]


def test_layers_are_ordered_input_to_output():
  params = {"params": {f"Dense_{i}": {} for i in (10, 2, 0, 1)}}
  assert layers.layer_names(params) == ["Dense_0", "Dense_1", "Dense_2", "Dense_10"]
  names = ["Dense_0", "Dense_1", "Dense_2"]
  assert layers.all_but_bottom_layers(1, "n")(names) == ["Dense_1", "Dense_2"]
  assert layers.all_but_top_layers(1, "n")(names) == ["Dense_0", "Dense_1"]
  for count in (0, 3):  # nothing or everything shared: not a partial-sharing method
    with pytest.raises(ConfigError, match="between 1 and 2"):
      layers.all_but_bottom_layers(count, "n")(names)
  # Across module types, convolutions come first (models.LAYER_TYPE_ORDER).
  assert layers.layer_names({"params": {n: {} for n in ("Dense_1", "Conv_1", "Dense_0",
                                                        "Conv_0")}}) == [
      "Conv_0", "Conv_1", "Dense_0", "Dense_1"]
  with pytest.raises(ConfigError, match="ambiguous.*'BatchNorm'.*LAYER_TYPE_ORDER"):
    layers.layer_names({"params": {"BatchNorm_0": {}, "Dense_0": {}}})


# A sample input of every registered model (a new model adds one here).
SAMPLE_INPUTS = {"mlp": np.zeros((1, 4), np.float32),
                 "cnn": np.zeros((1, 28, 28, 1), np.uint8),
                 "coaching_cnn": np.zeros((1, 28, 28, 1), np.uint8),
                 "coaching_cnn_bn": np.zeros((1, 28, 28, 1), np.uint8),
                 "fedavg_cnn": np.zeros((1, 32, 32, 3), np.uint8),
                 "pfl_cnn": np.zeros((1, 32, 32, 3), np.uint8),
                 "resnet18": np.zeros((1, 32, 32, 3), np.uint8),
                 "fasttext": np.zeros((1, 12), np.int32),   # token ids, 0 = padding
                 "fasttext_bag": np.zeros((1, 12), np.int32),
                 "char_lstm": np.zeros((1, 12), np.int32)}  # character ids
# Bodies that end without a ReLU: FedALA's fastText has none after its hidden layer, the
# character LSTM's last output is tanh-bounded.
LINEAR_BODIES = {"fasttext", "char_lstm"}


def _forward_order(model, params, x):
  """The model's top-level modules in the order its forward pass calls them."""
  order = []

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    scope = context.module.scope
    if context.method_name == "__call__" and scope is not None and len(scope.path) == 1:
      order.append(scope.path[0])
    return out
  with nn.intercept_methods(record):
    model.apply(params, x)
  return order


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_registered_model_has_its_layers_and_head_in_forward_order(name):
  assert set(SAMPLE_INPUTS) == set(MODELS)
  model = build_model(name, num_outputs=7, hidden=(5, 4))
  params = model.init(jax.random.key(0), SAMPLE_INPUTS[name])
  names = layers.layer_names(params)
  assert names == _forward_order(model, params, SAMPLE_INPUTS[name])
  assert sorted(names) == sorted(params["params"])
  body, head = layers.split_body_head(params, 1, "head_layers")
  assert body + head == names
  assert head == [names[-1]] and params["params"][head[0]]["bias"].shape == (7,)  # logits
  with pytest.raises(ConfigError, match=f"between 1 and {len(names) - 1}"):
    layers.split_body_head(params, len(names), "head_layers")
  # The representation (MOON, FedProto) is the body's output: the head maps it to the logits.
  x = np.random.default_rng(0).integers(0, 256, (3,) + SAMPLE_INPUTS[name].shape[1:])
  x = x.astype(SAMPLE_INPUTS[name].dtype)
  assert layers.head_layer(params) == head[0]
  logits, z = layers.apply_with_representation(model.apply, params, x, head[0])
  chex.assert_trees_all_close(logits, model.apply(params, x))
  dense = params["params"][head[0]]
  chex.assert_trees_all_close(z @ dense["kernel"] + dense["bias"], logits, atol=1e-5)
  assert (z >= 0).all() or name in LINEAR_BODIES  # the others end with a ReLU


@pytest.mark.parametrize("shape,expected", [((28, 28, 1), 582_026), ((32, 32, 3), 878_538)])
def test_fedavg_cnn_has_pfllibs_parameter_count(shape, expected):
  # By hand: conv 5*5*c*32 + 32, conv 5*5*32*64 + 64, dense d*512 + 512, dense 512*10 + 10,
  # with d = 4*4*64 = 1024 (MNIST) or 5*5*64 = 1600 (CIFAR-10).
  params = build_model("fedavg_cnn", num_outputs=10).init(
      jax.random.key(0), np.zeros((1,) + shape, np.uint8))
  assert sum(leaf.size for leaf in jax.tree.leaves(params)) == expected


def test_resnet18_has_the_cifar_resnet18_parameter_count():
  # By hand, 3x3 convolutions without bias, BatchNorm scale and shift per channel:
  # stem 3*3*3*64 + 2*64; a block of width c from width c_in, stride s:
  # 9*c_in*c + 9*c*c + 2*2*c, plus c_in*c + 2*c for the 1x1 shortcut when s = 2;
  # dense 512*10 + 10. Running averages: mean and variance per BatchNorm channel.
  def block(c_in, c, shortcut):
    return 9 * c_in * c + 9 * c * c + 4 * c + (c_in * c + 2 * c if shortcut else 0)
  expected = (27 * 64 + 128 + 2 * block(64, 64, False)
              + sum(block(c // 2, c, True) + block(c, c, False) for c in (128, 256, 512))
              + 512 * 10 + 10)
  assert expected == 11_173_962
  variables = jax.eval_shape(build_model("resnet18", num_outputs=10).init,  # shapes only
                             jax.random.key(0), np.zeros((1, 32, 32, 3), np.uint8))
  assert sum(leaf.size for leaf in jax.tree.leaves(variables["params"])) == expected
  channels = 64 + 4 * 64 + sum(5 * c for c in (128, 256, 512))  # BatchNorms' channels
  assert sum(leaf.size for leaf in jax.tree.leaves(variables["batch_stats"])) == 2 * channels


def _one_round(algorithm, trainer, data, params):
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape), params)
  state = RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(
      InitContext(params=stacked, data=data, trainer=trainer, key=jax.random.key(0))))
  state, _ = jax.jit(build_train_round(algorithm, trainer, data))(
      state, data.buckets, jax.random.key(1))
  return state.algorithm


@pytest.mark.parametrize("name, shared", [
    ("lg_fedavg", ["Dense_1", "Dense_2"]),  # local_layers=1: all above the input layer
    # local_side="output", local_layers=2: only the input layer shared (the shape of the
    # authors' CIFAR-10 script: convolutions global, dense layers local)
    ("lg_fedavg_output", ["Dense_0"]),
    ("fedper", ["Dense_0", "Dense_1"]),     # personal_layers=1: all but the head
])
def test_one_round_averages_only_the_shared_layers(name, shared):
  data, clients = tiny_data(SIZES)
  model = tiny_model(hidden=(5, 4))  # Dense_0, Dense_1, Dense_2
  trainer = tiny_trainer(model, lr=LR, batch_size=8)  # one full-batch step
  params = init_params(model)
  algorithm = {
      "lg_fedavg": lambda: lg_fedavg.lg_fedavg(lg_fedavg.LgFedAvgConfig(), trainer),
      "lg_fedavg_output": lambda: lg_fedavg.lg_fedavg(
          lg_fedavg.LgFedAvgConfig(local_layers=2, local_side="output"), trainer),
      "fedper": lambda: fedper.fedper(fedper.FedPerConfig(), trainer)}[name]()
  state = _one_round(algorithm, trainer, data, params)

  # Round 1: every client trains the whole shared initial model one step.
  trained = [jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(
      lambda p, c=c: mean_ce(model, p, c.x_train, c.y_train))(params)) for c in clients]
  assert sorted(state.server["params"]) == shared
  for layer in shared:
    expected = jax.tree.map(lambda a, b: (SIZES[0] * a + SIZES[1] * b) / sum(SIZES),
                            trained[0]["params"][layer], trained[1]["params"][layer])
    chex.assert_trees_all_close(state.server["params"][layer], expected, atol=1e-6)

  personalized = algorithm.personalized_params(state.server, state.clients)
  for k in range(len(SIZES)):
    for layer in ("Dense_0", "Dense_1", "Dense_2"):
      got = jax.tree.map(lambda a, k=k: a[k], personalized["params"][layer])
      want = state.server["params"][layer] if layer in shared else trained[k]["params"][layer]
      chex.assert_trees_all_close(got, want, atol=1e-6)

  # Round 2 starts from the client's own personal layers under the global shared ones,
  # and uploads only the shared layers.
  broadcast = algorithm.broadcast(state.server, state.clients)
  splits = jax.tree.map(lambda a: jnp.asarray(a[0]), data.buckets[0])
  client_0 = tree.first(state.clients)
  out = algorithm.client_update(client_0, tree.first(broadcast), splits,
                                jax.random.key(2))
  start = tree.first(personalized)
  expected = jax.tree.map(lambda p, g: p - LR * g, start, jax.grad(
      lambda p: mean_ce(model, p, clients[0].x_train, clients[0].y_train))(start))
  chex.assert_trees_all_close(out.state, expected, atol=1e-6)
  assert sorted(out.upload["params"]) == shared


def test_layer_counts_are_checked():
  trainer = tiny_trainer(tiny_model())
  with pytest.raises(ConfigError, match="lg_fedavg: local_layers"):
    lg_fedavg.lg_fedavg(lg_fedavg.LgFedAvgConfig(local_layers=0), trainer)
  with pytest.raises(ConfigError, match="lg_fedavg: local_side must be one of input, output"):
    lg_fedavg.lg_fedavg(lg_fedavg.LgFedAvgConfig(local_side="top"), trainer)
  with pytest.raises(ConfigError, match="fedper: personal_layers"):
    fedper.fedper(fedper.FedPerConfig(personal_layers=0), trainer)
  data, _ = tiny_data([4, 4])
  model = tiny_model()  # two layers: one local layer at most
  algorithm = lg_fedavg.lg_fedavg(lg_fedavg.LgFedAvgConfig(local_layers=2), trainer)
  stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (2,) + a.shape), init_params(model))
  with pytest.raises(ConfigError, match="between 1 and 1 for a model with 2 layers"):
    algorithm.init(InitContext(params=stacked, data=data, trainer=trainer,
                               key=jax.random.key(0)))
  np.testing.assert_equal(len(layers.layer_names(init_params(model))), 2)
