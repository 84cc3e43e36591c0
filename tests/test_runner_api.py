"""The runner takes an Algorithm: one written here, outside the registry, runs as a
registered one does."""

import jax
import numpy as np
import pytest

from fedora_jax import algorithms, train, tree
from fedora_jax.algorithms import ala, confree, fedora
from fedora_jax.algorithms.base import Algorithm, AlgorithmState, ClientOutput
from fedora_jax.algorithms.plugin_fields import WHOLE_SERVER, model_message
from fedora_jax.errors import ConfigError, FieldError
from fedora_jax.simulation import TrainConfig, client_trainer, prepare_run, run_algorithm
from tiny import tiny_data, tiny_model

TRAIN = TrainConfig(rounds=3, local_epochs=1, batch_size=4, lr=0.1, log_every=0)


def server_step_fedavg(step: float, plugins: bool = False):
  """FedAvg whose server moves `step` of the way to the clients' weighted mean (1: FedAvg),
  as a notebook would write it: a function of the run's client trainer. With `plugins`,
  it declares what ALA and ConFREE need."""
  def build(trainer) -> Algorithm:
    def init(context):
      return AlgorithmState(server=tree.first(context.params),
                            clients=context.params)  # each client's latest model

    def client_update(client_state, global_params, data, key):
      del client_state
      params, stats = trainer.train(global_params, data.train, key)
      return ClientOutput(state=params, upload=params, train=stats)

    def aggregate(server, clients, uploads, weights):
      mean = tree.weighted_mean(uploads, weights)
      moved = jax.tree.map(lambda g, m: g + step * (m - g), server, mean)
      return AlgorithmState(server=moved, clients=clients)

    def personalized_params(server, clients):
      return tree.broadcast_to_clients(server, tree.leading_size(clients))

    return Algorithm(name=f"server_step_{step}", init=init,
                     broadcast=lambda server, clients: tree.broadcast_to_clients(
                         server, tree.leading_size(clients)),
                     client_update=client_update, aggregate=aggregate,
                     personalized_params=personalized_params,
                     ala_hooks=model_message(personal_is_local=True) if plugins else None,
                     shared_part=WHOLE_SERVER if plugins else None)
  return build


def test_an_algorithm_written_outside_the_registry_runs_as_fedavg_at_step_one():
  data, _ = tiny_data([6, 9, 5])
  ours = run_algorithm(server_step_fedavg(1.0), tiny_model(), data, TRAIN, progress=None)
  registered = run_algorithm(algorithms.make("fedavg"), tiny_model(), data, TRAIN,
                             progress=None)
  assert ours.algorithm == "server_step_1.0"
  np.testing.assert_allclose(ours.history.test_score, registered.history.test_score)
  np.testing.assert_allclose(ours.history.val_loss, registered.history.val_loss, rtol=1e-5)
  # A half step moves the server half as far from the initial model in the first round.
  half = run_algorithm(server_step_fedavg(0.5), tiny_model(), data,
                       TrainConfig(rounds=1, local_epochs=1, batch_size=4, lr=0.1,
                                   log_every=0), progress=None)
  one = run_algorithm(server_step_fedavg(1.0), tiny_model(), data,
                      TrainConfig(rounds=1, local_epochs=1, batch_size=4, lr=0.1,
                                  log_every=0), progress=None)
  initial = prepare_run(server_step_fedavg(1.0), tiny_model(), data, TRAIN).state
  start = initial.algorithm.server
  for s, h, o in zip(*(jax.tree.leaves(t) for t in (
      start, half.final_state.algorithm.server, one.final_state.algorithm.server))):
    np.testing.assert_allclose(h - s, 0.5 * (o - s), rtol=1e-5, atol=1e-7)


def test_an_algorithm_object_built_on_the_run_s_trainer_runs():
  data, _ = tiny_data([6, 9, 5])
  model = tiny_model()
  built = server_step_fedavg(1.0)(client_trainer(model, data, TRAIN))
  from_object = run_algorithm(built, model, data, TRAIN, progress=None)
  from_function = run_algorithm(server_step_fedavg(1.0), model, data, TRAIN, progress=None)
  np.testing.assert_array_equal(from_object.history.test_score,
                                from_function.history.test_score)


def test_a_name_where_an_algorithm_belongs_is_a_one_line_error():
  data, _ = tiny_data([6, 9, 5])
  with pytest.raises(ConfigError, match=r"algorithms\.make\(name, config\)"):
    run_algorithm("fedavg", tiny_model(), data, TRAIN)
  with pytest.raises(ConfigError, match="not an Algorithm"):
    run_algorithm(lambda trainer: None, tiny_model(), data, TRAIN)


def test_a_host_takes_the_plugins_by_declaring_their_fields():
  data, _ = tiny_data([6, 9, 5])
  config = ala.AlaConfig(batch_size=4)

  def with_ala(trainer):
    return ala.with_ala(server_step_fedavg(1.0, plugins=True)(trainer), config, trainer)
  ours = run_algorithm(with_ala, tiny_model(), data, TRAIN, progress=None)
  fedala = run_algorithm(algorithms.make("fedala", config), tiny_model(), data, TRAIN,
                         progress=None)
  np.testing.assert_allclose(ours.history.test_score, fedala.history.test_score)
  np.testing.assert_allclose(ours.history.val_loss, fedala.history.val_loss, rtol=1e-5)

  def with_confree(trainer):
    return confree.with_confree(server_step_fedavg(1.0, plugins=True)(trainer),
                                confree.ConfreeConfig())
  ours = run_algorithm(with_confree, tiny_model(), data, TRAIN, progress=None)
  registered = run_algorithm(
      algorithms.make("fedavg", algorithms.Plugged(algorithms.default_config("fedavg"),
                                                   aggregation=confree.ConfreeConfig())),
      tiny_model(), data, TRAIN, progress=None)
  np.testing.assert_allclose(ours.history.val_loss, registered.history.val_loss, rtol=1e-5)

  undeclared = server_step_fedavg(1.0)
  with pytest.raises(ConfigError, match="declares none"):
    run_algorithm(lambda trainer: ala.with_ala(undeclared(trainer), config, trainer),
                  tiny_model(), data, TRAIN)
  with pytest.raises(ConfigError, match="declares none"):
    run_algorithm(lambda trainer: confree.with_confree(undeclared(trainer),
                                                       confree.ConfreeConfig()),
                  tiny_model(), data, TRAIN)


def test_new_clients_need_an_algorithm_that_serves_them():
  with pytest.raises(FieldError, match="fedavg does not; use it with fedora"):
    train.check_config(train.ExperimentConfig(algorithm=train.AlgorithmConfig("fedavg"),
                                              new_clients=train.NewClientsConfig(2)))
  random_similarity = fedora.config_for_variant(similarity="random")
  with pytest.raises(FieldError, match="principal_angles"):
    train.check_config(train.ExperimentConfig(
        algorithm=train.AlgorithmConfig("fedora", random_similarity),
        new_clients=train.NewClientsConfig(2)))


def test_a_run_s_variant_is_read_from_its_recorded_config():
  authors = fedora.config_for_variant("authors", lr=0.01)._asdict()
  assert algorithms.variant_label("fedora", authors) == "authors"
  paper = fedora.config_for_variant("paper", p=3)._asdict()
  assert algorithms.variant_label("fedora", paper) == "paper; p=3"
  assert algorithms.variant_label("fedavg", {}) is None
