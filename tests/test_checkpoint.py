"""Checkpoints: round trip, resume in-process and after kill -9, determinism, refusals.

The CLI tests share one persistent XLA compilation cache: compiling dominates a tiny run
on a small machine, and the later runs then execute exactly what the first one compiled.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedora_jax import checkpoint as checkpoint_lib
from fedora_jax import algorithms, settings, tree
from fedora_jax import config as config_lib
from fedora_jax import results as results_lib
from fedora_jax.algorithms import fedora
from fedora_jax.algorithms.base import AlgorithmState
from fedora_jax.checkpoint import Checkpointer, open_run
from fedora_jax.rounds import RoundMetrics, RoundState
from fedora_jax.errors import ConfigError
from fedora_jax.simulation import TrainConfig, run_algorithm
from tiny import tiny_data, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--num_clients=4", "--rounds=12", "--checkpoint_every=4", "--local_epochs=1",
       "--hidden=16", "--log_every=0"]
K = 3


def _metrics(r: int) -> RoundMetrics:
  values = np.arange(K, dtype=np.float32) + r
  return RoundMetrics(train_loss=values, local_steps=np.full(K, r, np.int32),
                      val_loss=values, val_score=values / 10, test_loss=values,
                      test_score=values / 20, extra={"lambda": values * 2})


def _states():
  params = {"params": {"Dense_0": {"kernel": jnp.arange(K * 6.0).reshape(K, 2, 3),
                                   "bias": jnp.ones((K, 3))}}}
  eye = jnp.eye(K)
  return {"fedora": AlgorithmState(fedora.FedoraServer(eye, 2 * eye, 3 * eye), params),
          "local": AlgorithmState((), params),
          "fedavg": AlgorithmState(tree.first(params), jnp.zeros(K))}


@pytest.mark.parametrize("algorithm", ["fedora", "local", "fedavg"])
def test_round_state_and_history_round_trip(algorithm, tmp_path):
  state = RoundState(round=jnp.array(4, jnp.int32), algorithm=_states()[algorithm])
  history = [_metrics(r) for r in range(4)]
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), every=2, max_to_keep=2)
  for done in (2, 3, 4):  # kept: the latest two
    checkpointer.save(state._replace(round=jnp.array(done, jnp.int32)), history[:done])
  assert checkpointer.latest_round() == 4
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4"]

  blank = jax.tree.map(jnp.zeros_like, state)
  restored = checkpointer.restore(blank, _metrics(0), total_rounds=10)
  assert jax.tree.structure(restored.state) == jax.tree.structure(state)
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  want_history = jax.tree.map(lambda *r: np.stack(r), *history)
  assert jax.tree.structure(restored.history) == jax.tree.structure(want_history)
  for got, want in zip(jax.tree.leaves(restored.history), jax.tree.leaves(want_history)):
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ConfigError, match="trained for 4 rounds; --rounds=3 cannot shorten"):
    checkpointer.restore(blank, _metrics(0), total_rounds=3)


def test_only_saving_starts_orbax_cleanup_thread(tmp_path, monkeypatch):
  # orbax cleans up an interrupted save's temporary folders in a thread that its save
  # waits for but its close() does not; a run refused just after reading its checkpoints
  # (--rounds below them) exited with that thread running, which printed a traceback (CI,
  # 2026-11-29). So only the manager that saves may ask for the cleanup.
  asked = []
  manager_class = checkpoint_lib.ocp.CheckpointManager

  def recording_manager(directory, options):
    asked.append(options.cleanup_tmp_directories)
    return manager_class(directory, options=options)

  monkeypatch.setattr(checkpoint_lib.ocp, "CheckpointManager", recording_manager)
  state = RoundState(round=jnp.array(2, jnp.int32), algorithm=_states()["local"])
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), every=1)
  checkpointer.save(state, [_metrics(r) for r in range(2)])
  assert asked == [True]
  assert checkpointer.latest_round() == 2
  checkpointer.restore(jax.tree.map(jnp.zeros_like, state), _metrics(0), total_rounds=5)
  assert asked == [True, False, False, False]  # restore reads latest_round first


def test_typed_keys_are_refused_not_saved_wrong(tmp_path):
  state = RoundState(round=jnp.array(1, jnp.int32),
                     algorithm=AlgorithmState(jax.random.key(0), jnp.zeros(K)))
  with pytest.raises(TypeError, match="key_data"):
    Checkpointer(str(tmp_path), every=1).save(state, [_metrics(0)])


def _record(config):
  """run_config.json's document for `config` and how another record differs from it."""
  return config_lib.record(config), lambda recorded: config_lib.differences(recorded, config)


def claim_workdir(workdir, config):
  checkpoint_lib.claim_workdir(str(workdir), *_record(config))


def check_workdir(workdir, config):
  return checkpoint_lib.check_workdir(str(workdir), *_record(config))


def _config(**given):
  return settings.from_settings({"algorithm": "fedavg", "hidden": ["16"], **given})


def test_workdir_keeps_the_identity_of_its_run(tmp_path):
  config = _config()
  claim_workdir(tmp_path, _config(seed=7))
  claim_workdir(tmp_path, config)  # nothing trained under seed 7: taken over
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  claim_workdir(tmp_path, config)  # the same run again: resumable
  recorded = json.loads((tmp_path / "run_config.json").read_text())
  assert recorded["schema_version"] == config_lib.SCHEMA_VERSION
  assert recorded["config"]["model"]["hidden"] == [16]
  assert recorded["config"] == config_lib.as_dict(config_lib.resolve(config))
  with pytest.raises(ConfigError, match=r"other settings: data.data_seed=0 \(now 1\),"
                     r" train.lr=0.005 \(now 0.1\), train.seed=0 \(now 1\); rerun with its"
                     " settings"):
    claim_workdir(tmp_path, _config(lr=0.1, seed=1))
  document, differences = _record(config)
  assert open_run(str(tmp_path), document, differences, rounds=5, checkpoint_every=0) is None
  # A field added after this run was recorded, at its default: the same run (a record
  # made before the field existed is read at the field's default).
  del recorded["config"]["train"]["participation"]
  (tmp_path / "run_config.json").write_text(json.dumps(recorded))
  claim_workdir(tmp_path, config)
  (tmp_path / "run_config.json").write_text(json.dumps(recorded))
  with pytest.raises(ConfigError, match=r"train.participation=1.0 \(now 0.5\)"):
    claim_workdir(tmp_path, _config(participation=0.5))
  # check_workdir says the same and writes nothing (a sweep checks every row first).
  before = (tmp_path / "run_config.json").read_bytes()
  assert check_workdir(tmp_path, config)
  with pytest.raises(ConfigError, match=r"train.seed=0 \(now 1\)"):
    check_workdir(tmp_path, _config(seed=1))
  assert (tmp_path / "run_config.json").read_bytes() == before
  assert not check_workdir(tmp_path / "fresh", config)
  assert not (tmp_path / "fresh").exists()


def test_resume_and_extend_match_an_uninterrupted_run(tmp_path):
  data, _ = tiny_data([6, 6, 6])
  model = tiny_model()
  config = fedora.config_for_variant("paper", lr=0.1)

  def train(rounds, checkpointer=None):
    return run_algorithm(algorithms.make("fedora", config), model, data,
                         TrainConfig(rounds=rounds, local_epochs=1, batch_size=4, lr=0.1,
                                     log_every=0), checkpointer=checkpointer)
  straight = train(5)
  checkpointer = Checkpointer(str(tmp_path), every=2)
  first = train(3, checkpointer)
  assert first.resumed_from_round == 0  # saves after rounds 2 and 3
  finished = train(3, checkpointer)  # restored after its last round: nothing to train
  assert finished.resumed_from_round == 3 and finished.round_seconds == 0.0
  np.testing.assert_array_equal(finished.history.test_score, straight.history.test_score[:3])
  extended = train(5, checkpointer)  # the finished 3-round run, extended to 5
  assert extended.resumed_from_round == 3 and checkpointer.latest_round() == 5
  for got, want in zip(jax.tree.leaves((extended.history, extended.final_state)),
                       jax.tree.leaves((straight.history, straight.final_state))):
    np.testing.assert_array_equal(got, want)

  # timing.json: one segment per process that trained rounds, summed over the run.
  timing = results_lib.timing(first, "cpu x1")
  assert [(s["first_round"], s["last_round"]) for s in timing["segments"]] == [(0, 3)]
  assert results_lib.timing(finished, "cpu x1", timing)["segments"] == timing["segments"]
  timing = results_lib.timing(extended, "cpu x1", timing)
  assert [(s["first_round"], s["last_round"]) for s in timing["segments"]] == [(0, 3), (3, 5)]
  r1, r2 = (round(r.round_seconds, 5) for r in (first, extended))
  np.testing.assert_allclose(timing["round_seconds_all"], (3 * r1 + 2 * r2) / 5, atol=1e-5)
  np.testing.assert_allclose(
      timing["seconds_all"], sum(r.compile_seconds + r.total_seconds
                                 for r in (first, extended)), atol=2e-3)
  # A fresh run (nothing resumed) starts its own record.
  assert len(results_lib.timing(straight, "cpu x1", timing)["segments"]) == 1
  # Each segment names its machine.
  timing = results_lib.timing(extended, "NVIDIA H200 x1", results_lib.timing(first, "cpu x1"))
  assert results_lib.machines(timing) == "cpu x1 + NVIDIA H200 x1"
  assert results_lib.this_machine().startswith("cpu x")
  # write_timing twice for one result (when its rounds end, then with the other files)
  # writes the same record; a run whose rounds no finished process timed costs NaN ("—").
  results_lib.write_timing(str(tmp_path / "run"), first)
  once = (tmp_path / "run" / "timing.json").read_text()
  results_lib.write_timing(str(tmp_path / "run"), first)
  assert (tmp_path / "run" / "timing.json").read_text() == once
  untimed = results_lib.run_cost(results_lib.timing(finished, "cpu x1"))
  assert np.isnan(untimed["round_seconds"]) and np.isnan(untimed["wall_seconds"])
  assert results_lib.seconds_text(untimed["round_seconds"], 3) == "—"
  assert results_lib.seconds_text(2.5, 3) == "2.500"
  assert results_lib.run_cost(timing)["round_seconds"] == timing["round_seconds_all"]


# --- The CLI: kill -9 and resume, determinism, refusal. ---------------------------------


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
  cache = tmp_path_factory.mktemp("xla_cache")
  return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _command(workdir, *extra):
  return [sys.executable, "-m", "experiments.main", f"--workdir={workdir}", *RUN, *extra]


def _run_main(env, workdir, *extra):
  return subprocess.run(_command(workdir, *extra), cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


@pytest.fixture(scope="module")
def straight(cli_env, tmp_path_factory):
  """An uninterrupted run: FEDORA, then the LOCAL reference it trains."""
  workdir = tmp_path_factory.mktemp("straight")
  proc = _run_main(cli_env, workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


def _assert_same_results(workdir, reference):
  for name in ("results.json", "local/results.json", "clients.csv", "rounds.csv"):
    assert (workdir / name).read_bytes() == (reference / name).read_bytes(), name
  with np.load(workdir / "history.npz") as got, np.load(reference / "history.npz") as want:
    assert sorted(got) == sorted(want)
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])


def _committed_checkpoint(directory) -> bool:
  # orbax renames a checkpoint to its bare round number only once it is complete.
  return directory.is_dir() and any(name.isdigit() for name in os.listdir(directory))


def test_how_a_run_is_laid_out_and_where_its_data_sits_are_outside_its_identity(tmp_path):
  # Evaluation chunks (--eval_batch_size: 1024 for every model until 2026-11-26, 64 for
  # the CNNs on CPUs since) and clients per lax.map (--client_chunk) change only how
  # sums are rounded, as another device count does; the data's folder, the rounds (a
  # longer run extends a shorter one) and the logging change nothing: a run recorded
  # with any of them resumes with others. Everything else counts.
  claim_workdir(tmp_path, _config(eval_batch_size=1024, client_chunk=0, rounds=20,
                                  data_dir="/old/place/of/the/data", log_every=5))
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  moved = _config(eval_batch_size=32, client_chunk=2, rounds=50, data_dir="/new/place")
  assert check_workdir(tmp_path, moved)
  assert "data_dir" not in config_lib.identity(moved)["data"]
  with pytest.raises(ConfigError, match="train.seed=0 \\(now 1\\)"):
    check_workdir(tmp_path, _config(seed=1, data_dir="/new/place"))
  with pytest.raises(ConfigError, match="train.batch_size=64 \\(now 32\\)"):
    check_workdir(tmp_path, _config(batch_size=32))


def test_a_record_of_the_flag_named_format_is_refused_until_converted(tmp_path):
  # run_config.json held the run's flags by name until 2026-12-05 (schema 1): such a
  # workdir is refused, naming the script that converts it, which reads the record by
  # the rules of its time (FEDORA's variant absent: "paper", the default until
  # 2026-11-26), so the same run resumes afterwards and another is still refused.
  flag_record = {"algorithm": "fedavg", "seed": 0, "lr": 0.005, "hidden": ["16"],
                 "data_dir": "/old/place", "client_weights": "uniform"}
  (tmp_path / "run_config.json").write_text(json.dumps(flag_record))
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  config = _config(client_weights="uniform")
  with pytest.raises(ConfigError, match="recorded in another format .*schema_version None,"
                     " now 2.*scripts/migrate_run_configs.py"):
    check_workdir(tmp_path, config)
  proc = subprocess.run([sys.executable, "scripts/migrate_run_configs.py", str(tmp_path)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip() == "1 converted", proc.stderr
  assert check_workdir(tmp_path, config)
  with pytest.raises(ConfigError, match="train.client_weights='uniform' \\(now 'samples'\\)"):
    check_workdir(tmp_path, _config())


def test_a_run_of_the_old_default_variant_is_not_resumed_as_the_new(straight, cli_env,
                                                                   tmp_path):
  # FEDORA's default was the equations as printed until 2026-11-26: a workdir recorded
  # then holds the paper variant's config and must not continue as the authors' variant.
  old = tmp_path / "old_default"
  old.mkdir()
  recorded = json.loads((straight / "run_config.json").read_text())
  authors = recorded["config"]["algorithm"]["config"]
  assert authors == fedora.config_for_variant("authors", lr=0.005)._asdict()  # as values
  paper = fedora.config_for_variant("paper", lr=0.005)._asdict()
  recorded["config"]["algorithm"]["config"] = paper
  (old / "run_config.json").write_text(json.dumps(recorded))
  (old / "results.json").write_bytes((straight / "results.json").read_bytes())
  proc = _run_main(cli_env, old)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "other settings: algorithm.config.alpha=1.0 (now 4.0)" in proc.stderr
  assert "algorithm.config.pull='prox' (now 'decoupled')" in proc.stderr
  # A flag-named record of the time (no variant: the old default) is refused until
  # converted, and then as the paper variant.
  (old / "run_config.json").write_text(json.dumps(
      {"algorithm": "fedora", "num_clients": 4, "local_epochs": 1, "hidden": ["16"]}))
  proc = _run_main(cli_env, old)
  assert proc.returncode == 1 and "scripts/migrate_run_configs.py" in proc.stderr
  subprocess.run([sys.executable, "scripts/migrate_run_configs.py", str(old)], cwd=ROOT,
                 env=cli_env, check=True, capture_output=True, timeout=300)
  proc = _run_main(cli_env, old)
  assert proc.returncode == 1 and "algorithm.config.pull='prox' (now 'decoupled')" in proc.stderr


# The CLI's run as a Python config: the same settings, and the CLI's layout of the clients
# on this platform (outside the identity, but it sets the rounding of the sums).
PYTHON_RUN = """
import logging
import sys
import jax
from fedora_jax import models, train
from fedora_jax.engine import sharding
jax.config.update("jax_num_cpu_devices", sharding.cpu_device_count())
logging.getLogger("fedora_jax").setLevel(logging.INFO)
logging.getLogger("fedora_jax").addHandler(logging.StreamHandler())
config = train.ExperimentConfig(
    data=train.DataConfig(num_clients=4), model=train.ModelConfig(hidden=(16,)),
    train=train.TrainConfig(rounds=int(sys.argv[2]), local_epochs=1, log_every=0,
                            client_chunk=models.default_client_chunk("mlp", "cpu")),
    checkpoint_every=4)
train.train_and_evaluate(config, sys.argv[1], progress=None)
"""


def _run_python(env, workdir, rounds):
  return subprocess.run([sys.executable, "-c", PYTHON_RUN, str(workdir), str(rounds)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_started_from_python_resumes_from_the_cli_and_the_reverse(straight, cli_env,
                                                                        tmp_path):
  # Started in Python, stopped after 8 of the 12 rounds, finished by the command line:
  # the same results as the command's uninterrupted run.
  workdir = tmp_path / "python_first"
  proc = _run_python(cli_env, workdir, 8)
  assert proc.returncode == 0, proc.stderr[-3000:]
  proc = _run_main(cli_env, workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fedora: resuming after round 8 of 12" in proc.stderr
  assert "local: resuming after round 8 of 12" in proc.stderr
  _assert_same_results(workdir, straight)
  # Started by the command line (finished, here), read back from Python: nothing to train.
  workdir = tmp_path / "cli_first"
  shutil.copytree(straight, workdir)
  proc = _run_python(cli_env, workdir, 12)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fedora: resuming after round 12 of 12" in proc.stderr
  _assert_same_results(workdir, straight)


def test_killed_run_resumes_to_the_same_results(straight, cli_env, tmp_path):
  workdir = tmp_path / "killed"
  with open(tmp_path / "killed.log", "w") as log:
    proc = subprocess.Popen(_command(workdir), cwd=ROOT, env=cli_env, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not _committed_checkpoint(workdir / "checkpoints"):
      assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
      assert time.monotonic() < deadline, "no checkpoint after 300 s"
      time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
  # Even if FEDORA had finished, the LOCAL reference was still to come.
  assert not (workdir / "local" / "results.json").exists()

  proc = _run_main(cli_env, workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fedora: resuming after round" in proc.stderr
  assert json.loads((workdir / "timing.json").read_text())["resumed_from_round"] > 0
  _assert_same_results(workdir, straight)


def test_same_flags_give_identical_results(straight, cli_env, tmp_path):
  # Checkpointing is not part of what a run computes: off here, on in `straight`.
  proc = _run_main(cli_env, tmp_path / "again", "--checkpoint_every=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not (tmp_path / "again" / "checkpoints").exists()
  _assert_same_results(tmp_path / "again", straight)


def test_nokeep_checkpoints_deletes_them_once_finished(straight, cli_env, tmp_path):
  # Saved as usual while training (a killed run resumes), gone once the run and its
  # LOCAL reference are finished; what a finished row is read from stays.
  workdir = tmp_path / "pruned"
  proc = _run_main(cli_env, workdir, "--nokeep_checkpoints")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for run in (workdir, workdir / "local"):
    assert (run / "run_config.json").is_file() and not (run / "checkpoints").exists()
    for name in ("results.json", "history.npz", "timing.json"):
      assert (run / name).is_file(), name
  assert (straight / "checkpoints").is_dir() and (straight / "local" / "checkpoints").is_dir()
  _assert_same_results(workdir, straight)


@pytest.mark.parametrize("extra,message", [
    (["--lr=0.1"], "holds a run with other settings: algorithm.config.lr=0.005 (now 0.1),"
     " train.lr=0.005 (now 0.1)"),
    (["--fedora_variant=paper"], "other settings: algorithm.config.alpha=4.0 (now 1.0)"),
    (["--rounds=8"], "trained for 12 rounds; --rounds=8 cannot shorten it"),
])
def test_workdir_of_another_run_is_refused(straight, cli_env, extra, message):
  before = (straight / "run_config.json").read_bytes()
  proc = _run_main(cli_env, straight, *extra)
  assert proc.returncode == 1
  assert "Traceback" not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
  assert (straight / "run_config.json").read_bytes() == before


def test_remove_unfinished_deletes_a_cut_short_save_and_keeps_the_finished(tmp_path):
  finished = tmp_path / "checkpoints" / "2"
  partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1733300000"
  for folder in (finished, partial):
    folder.mkdir(parents=True)
    (folder / "data").write_text("x")
  Checkpointer(str(tmp_path / "checkpoints"), every=1).remove_unfinished()
  assert finished.is_dir() and not partial.exists()
