"""Clients as they really are: dropout, availability traces, stragglers and a
round deadline, drawn from the round key and applied as masks on the sampled clients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import availability, train as train_lib
from fedora_jax.algorithms import fedavg
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput, InitContext
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.rounds import RoundState, build_train_round, sampled_clients
from fedora_jax.simulation import TrainConfig
from tiny import init_params, tiny_data, tiny_model, tiny_trainer

SIZES = (5, 6, 9, 5, 8, 7, 4, 3)       # distinct enough: n_k tells the clients apart
KEY = jax.random.key(7)


def test_parse_speed():
  assert availability.parse_speed("uniform:0.1,1") == (0.1, 1.0)
  assert availability.parse_speed("0.5") == (0.5, 0.5)
  for bad in ("uniform:0.5", "uniform:0.6,0.2", "0", "1.5", "normal:0.1,1", "fast", ""):
    with pytest.raises(FieldError, match="straggler_speed must be uniform:LO,HI"):
      availability.parse_speed(bad)


@pytest.mark.parametrize("settings, message", [
    (dict(dropout=1.0), r"client_dropout must be in \[0, 1\), got 1.0"),
    (dict(dropout=-0.1), r"client_dropout must be in \[0, 1\), got -0.1"),
    (dict(stragglers=1.5), r"stragglers must be in \[0, 1\], got 1.5"),
    (dict(deadline=-1.0), "round_deadline must be >= 0"),
    # Every client straggles at 0.4 at most: it needs 2.5 full clients' times.
    (dict(stragglers=1.0, speed="uniform:0.1,0.4", deadline=2.0),
     "round_deadline of 2 can be met by no client: the fastest needs 2.5"),
    # Whoever does not straggle needs 1.
    (dict(stragglers=0.5, deadline=0.8), "round_deadline of 0.8 can be met by no client"),
])
def test_bad_settings_stop_with_one_line(settings, message):
  arguments = dict(dropout=0.0, stragglers=0.0, speed=availability.DEFAULT_SPEED,
                   deadline=0.0) | settings
  with pytest.raises(FieldError, match=message) as error:
    availability.check_settings(**arguments)
  assert "\n" not in str(error.value)


def test_the_cli_names_the_flag():
  config = train_lib.ExperimentConfig(algorithm=train_lib.AlgorithmConfig("fedavg"),
                                      train=TrainConfig(client_dropout=1.0))
  with pytest.raises(FieldError) as error:
    train_lib.check_config(config)
  from experiments import flags  # pylint: disable=import-outside-toplevel
  assert flags.as_flag_error(error.value) == "--client_dropout must be in [0, 1), got 1.0"


def test_a_deadline_some_client_meets_is_accepted():
  availability.check_settings(0.0, 1.0, "uniform:0.1,0.4", 2.5)
  availability.check_settings(0.0, 0.5, "0.2", 1.0)


def test_load_trace(tmp_path):
  text = tmp_path / "trace.txt"
  text.write_text("# round 1 then round 2\n1 0 1\n0,1,1\n")
  np.testing.assert_array_equal(availability.load_trace(str(text), 3),
                                [[True, False, True], [False, True, True]])
  npy = tmp_path / "trace.npy"
  np.save(npy, np.array([[1, 1, 0]], np.int8))
  np.testing.assert_array_equal(availability.load_trace(str(npy), 3), [[True, True, False]])
  with pytest.raises(ConfigError, match="has 3 columns, but the run has 4 clients") as error:
    availability.load_trace(str(text), 4)
  assert "\n" not in str(error.value)
  text.write_text("1 0 2\n")
  with pytest.raises(ConfigError, match="values other than 0 and 1"):
    availability.load_trace(str(text), 3)
  text.write_text("1 0 x\n")
  with pytest.raises(ConfigError, match="cannot read a 0/1 table"):
    availability.load_trace(str(text), 3)
  with pytest.raises(ConfigError, match="no such file"):
    availability.build_conditions(trace=str(tmp_path / "missing.txt"), num_clients=3)


def test_nothing_on_builds_no_conditions():
  assert availability.build_conditions(num_clients=5) is None


def test_which_clients_drop_for_a_given_key():
  """Hand-checked: the round keys' uniform draws, fold_in(round key, K + 1), are
  round 0: .139 .063 .535 .769 .578 .976 .987 .527 -> below 0.5: clients 0, 1;
  round 1: .793 .045 .073 .212 .912 .117 .797 .621 -> clients 1, 2, 3, 5."""
  conditions = availability.build_conditions(dropout=0.5, num_clients=8)
  dropped = [np.flatnonzero(~np.asarray(availability.draw(
      conditions, jax.random.fold_in(KEY, r), jnp.asarray(r), 8).arrives)).tolist()
             for r in range(2)]
  assert dropped == [[0, 1], [1, 2, 3, 5]]


def test_speeds_and_the_deadline():
  conditions = availability.build_conditions(stragglers=0.5, speed="uniform:0.2,1",
                                             num_clients=8)
  fate = availability.draw(conditions, jax.random.fold_in(KEY, 0), jnp.asarray(0), 8)
  speed = np.asarray(fate.speed)
  straggling = speed < 1
  assert 0 < straggling.sum() < 8 and (speed[straggling] >= 0.2).all()
  assert np.asarray(fate.arrives).all()   # partial work: everybody sends something
  late = conditions._replace(deadline=2.0)
  fate = availability.draw(late, jax.random.fold_in(KEY, 0), jnp.asarray(0), 8)
  np.testing.assert_array_equal(fate.arrives, speed >= 0.5)   # 1 / s <= 2
  np.testing.assert_array_equal(fate.speed, np.ones(8))       # the punctual train it all


def spy_algorithm(trainer) -> Algorithm:
  """Trains each client's own model and counts its updates; uploads n_k; the server keeps
  the weights and uploads `aggregate` saw (server state [2, K])."""
  def init(context: InitContext) -> AlgorithmState:
    num_clients = context.data.num_clients
    return AlgorithmState(server=jnp.zeros((2, num_clients)),
                          clients=(jnp.zeros(num_clients, jnp.int32), context.params))

  def client_update(state, message, data, key):
    del message
    updates, params = state
    params, stats = trainer.train(params, data.train, key)
    return ClientOutput(state=(updates + 1, params),
                        upload=data.train.n.astype(jnp.float32), train=stats)

  def aggregate(server, clients, uploads, weights):
    del server
    return AlgorithmState(server=jnp.stack([weights, uploads]), clients=clients)

  return Algorithm(name="spy", init=init, broadcast=lambda server, clients: (),
                   client_update=client_update, aggregate=aggregate,
                   personalized_params=lambda server, clients: clients[1])


def _start(algorithm, trainer, data, model):
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (data.num_clients,) + a.shape),
                        init_params(model))
  return RoundState(round=jnp.zeros((), jnp.int32), algorithm=algorithm.init(InitContext(
      params=params, data=data, trainer=trainer, key=jax.random.key(0))))


@pytest.mark.parametrize("participation", [1.0, 0.5])
def test_a_dropped_client_looks_to_the_server_like_one_not_sampled(participation):
  data, _ = tiny_data(SIZES)
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4)
  algorithm = spy_algorithm(trainer)
  conditions = availability.build_conditions(dropout=0.5, num_clients=len(SIZES))
  round_fn = jax.jit(build_train_round(algorithm, trainer, data, participation=participation,
                                       conditions=conditions))
  start = _start(algorithm, trainer, data, model)
  before = jax.tree.map(np.asarray, start.algorithm.clients)
  state, metrics = round_fn(start, data.buckets, KEY)

  sampled = np.ones(len(SIZES), bool)
  if participation < 1:
    sampled = np.asarray(sampled_clients(jax.random.fold_in(KEY, 0), len(SIZES), 4))
  arrived = sampled & ~np.isin(np.arange(len(SIZES)), [0, 1])   # round 0 drops 0 and 1
  assert (sampled & ~arrived).any() and arrived.any()
  weights, uploads = np.asarray(state.algorithm.server)
  n = np.asarray(SIZES, np.float32)
  np.testing.assert_array_equal(weights, np.where(arrived, n, 0))
  np.testing.assert_array_equal(uploads, np.where(arrived, n, 0))
  updates, params = state.algorithm.clients
  np.testing.assert_array_equal(updates, arrived.astype(np.int32))
  for new, old in zip(jax.tree.leaves(params), jax.tree.leaves(before[1])):
    np.testing.assert_array_equal(np.asarray(new)[~arrived], old[~arrived])
    assert not np.allclose(np.asarray(new)[arrived], old[arrived])
  assert (np.asarray(metrics.local_steps)[arrived] > 0).all()
  assert (np.asarray(metrics.local_steps)[~arrived] == 0).all()
  assert np.isnan(np.asarray(metrics.train_loss)[~arrived]).all()
  # Every sampled client received the (empty) broadcast; only the arrived sent.
  np.testing.assert_array_equal(metrics.bytes_up, np.where(arrived, 4, 0))
  np.testing.assert_array_equal(metrics.bytes_down, np.zeros(len(SIZES)))


def test_a_stragglers_steps_are_counted():
  """Every client straggles at speed 0.5: of its T = 2 epochs x ceil(n / 4) real steps
  it completes floor(T / 2), at least 1."""
  data, _ = tiny_data(SIZES)
  model = tiny_model()
  trainer = tiny_trainer(model, epochs=2, batch_size=4)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  conditions = availability.build_conditions(stragglers=1.0, speed="0.5",
                                             num_clients=len(SIZES))
  round_fn = jax.jit(build_train_round(algorithm, trainer, data, conditions=conditions))
  _, metrics = round_fn(_start(algorithm, trainer, data, model), data.buckets, KEY)
  # n = 5 6 9 5 8 7 4 3 -> T = 4 4 6 4 4 4 2 2 -> half of each
  np.testing.assert_array_equal(metrics.local_steps, [2, 2, 3, 2, 2, 2, 1, 1])
  assert np.isfinite(np.asarray(metrics.train_loss)).all()


def test_a_deadline_drops_the_slow_and_the_others_train_every_step():
  data, _ = tiny_data(SIZES)
  model = tiny_model()
  trainer = tiny_trainer(model, epochs=2, batch_size=4)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  conditions = availability.build_conditions(stragglers=0.5, speed="uniform:0.2,1",
                                             deadline=2.0, num_clients=len(SIZES))
  round_fn = jax.jit(build_train_round(algorithm, trainer, data, conditions=conditions))
  _, metrics = round_fn(_start(algorithm, trainer, data, model), data.buckets, KEY)
  fate = availability.draw(conditions, jax.random.fold_in(KEY, 0), jnp.asarray(0), len(SIZES))
  full = 2 * np.ceil(np.asarray(SIZES) / 4).astype(np.int32)
  arrived = np.asarray(fate.arrives)
  assert 0 < arrived.sum() < len(SIZES)
  np.testing.assert_array_equal(metrics.local_steps, np.where(arrived, full, 0))


def test_a_round_nobody_arrives_at_changes_nothing(tmp_path):
  """Round 1 of the trace has everyone offline: state as it was, nothing sent either way;
  round 2 (row 0 again: the trace repeats) trains clients 0 and 2 only."""
  sizes = SIZES[:3]
  data, _ = tiny_data(sizes)
  model = tiny_model()
  trainer = tiny_trainer(model, batch_size=4)
  algorithm = fedavg.fedavg(fedavg.FedAvgConfig(), trainer)
  trace = tmp_path / "trace.txt"
  trace.write_text("1 0 1\n0 0 0\n")
  conditions = availability.build_conditions(trace=str(trace), num_clients=3)
  round_fn = jax.jit(build_train_round(algorithm, trainer, data, conditions=conditions))
  state, first = round_fn(_start(algorithm, trainer, data, model), data.buckets, KEY)
  np.testing.assert_array_equal(first.local_steps > 0, [True, False, True])
  server = jax.tree.map(np.asarray, state.algorithm.server)
  state, second = round_fn(state, data.buckets, KEY)
  np.testing.assert_array_equal(second.local_steps, [0, 0, 0])
  np.testing.assert_array_equal(second.bytes_up + second.bytes_down, [0, 0, 0])
  for new, old in zip(jax.tree.leaves(state.algorithm.server), jax.tree.leaves(server)):
    np.testing.assert_array_equal(new, old)
  assert np.isfinite(np.asarray(second.val_loss)).all()
  _, third = round_fn(state, data.buckets, KEY)
  np.testing.assert_array_equal(third.local_steps > 0, [True, False, True])
