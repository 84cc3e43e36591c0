"""Checkpoints and workdir identity, so a killed run resumes and ends as if never stopped.

What a run needs to continue exactly: its RoundState (the round counter and the
algorithm's server and client pytrees) and the per-round metric history so far (the
best-validation round is picked from all of it at the end). Nothing else: round keys are
fold_in(seed's train key, round counter), the client optimizer is re-created every round,
and the data split and initial model are rebuilt from the seeds. The state holds no typed
PRNG keys; `save` refuses one rather than store it in a form that restores wrong.

Checkpoints are written with orbax's CheckpointManager into numbered folders; each is
written under a temporary name and renamed when complete, so a kill -9 mid-save leaves
the previous checkpoint intact (the leftover is removed on the next start). Saves are
synchronous: the next round donates the state's buffers, so they must be on disk first.

A workdir's `run_config.json` records what its run computes (its identity); a run with
another identity is refused instead of being mixed into it.
"""

import json
import logging
import os
import shutil
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from fedora_jax.rounds import RoundMetrics, RoundState
from fedora_jax.errors import ConfigError, DataError

RUN_CONFIG = "run_config.json"
CHECKPOINTS = "checkpoints"


class Checkpoint(NamedTuple):
  state: RoundState
  history: RoundMetrics  # numpy, every field [rounds done, K] (extra: dict of [rounds, K])


def stack_history(rounds: list[RoundMetrics]) -> RoundMetrics:
  """Per-round host metrics -> one RoundMetrics whose fields are [R, K]."""
  return jax.tree.map(lambda *per_round: np.stack(per_round), *rounds)


def unstack_history(history: RoundMetrics) -> list[RoundMetrics]:
  num_rounds = history.test_score.shape[0]
  return [jax.tree.map(lambda a, r=r: a[r], history) for r in range(num_rounds)]


def history_template(round_metrics: RoundMetrics, num_rounds: int) -> RoundMetrics:
  """Zeros shaped like `num_rounds` stacked rounds of `round_metrics`. numpy leaves, so
  the history is restored to the host, where the run loop keeps it."""
  return jax.tree.map(lambda m: np.zeros((num_rounds,) + tuple(m.shape), m.dtype),
                      round_metrics)


class _DropOrbaxInfo(logging.Filter):
  """orbax logs ~50 INFO lines per save through absl; keep its warnings and errors."""

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}" in record.pathname
    return record.levelno >= logging.WARNING or not from_orbax


_DROP_ORBAX_INFO = _DropOrbaxInfo()


def _check_no_typed_keys(tree) -> None:
  for leaf in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      raise TypeError("the round state holds a typed PRNG key; store "
                      "jax.random.key_data(key) in it and wrap_key_data when using it")


class Checkpointer(NamedTuple):
  """Where and how often one run (one algorithm) saves its checkpoints.

  Each call opens a short-lived CheckpointManager: saves are rare (every `every` rounds)
  and synchronous, so there is no open manager to keep alive or to close.
  """
  directory: str
  every: int            # save after every `every` rounds, and after the last one
  max_to_keep: int = 3

  def _manager(self, cleanup: bool = False) -> ocp.CheckpointManager:
    # `cleanup` removes the temporary folders of an interrupted save. orbax does it in a
    # background thread that its save waits for but its close() does not, so only the
    # saving manager asks for it: a manager that only reads, closed just before a run
    # exits (a refused workdir), would leave that thread printing a traceback at exit.
    logging.getLogger("absl").addFilter(_DROP_ORBAX_INFO)  # a no-op once added
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.max_to_keep, enable_async_checkpointing=False,
        cleanup_tmp_directories=cleanup)
    return ocp.CheckpointManager(os.path.abspath(self.directory), options=options)

  def remove_unfinished(self) -> None:
    """Deletes the temporary folder of a save cut short (Ctrl-C mid-save); the finished
    checkpoints stay. orbax names it <round>.orbax-checkpoint-tmp-<time>."""
    if os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if ".orbax-checkpoint-tmp" in name:
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def latest_round(self) -> int | None:
    """Rounds done by the latest complete checkpoint, or None if there is none."""
    if not os.path.isdir(self.directory):
      return None
    with self._manager() as manager:
      return manager.latest_step()

  def due(self, rounds_done: int, total_rounds: int) -> bool:
    return rounds_done % self.every == 0 or rounds_done == total_rounds

  def save(self, state: RoundState, history: list[RoundMetrics]) -> None:
    """Saves the state after len(history) rounds and the history of those rounds."""
    _check_no_typed_keys(state)
    with self._manager(cleanup=True) as manager:
      manager.save(len(history), args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          history=ocp.args.StandardSave(stack_history(history))))

  def restore(self, state_template: RoundState, round_metrics: RoundMetrics,
              total_rounds: int) -> Checkpoint | None:
    """The latest checkpoint, or None. `state_template` gives the state's structure,
    shapes and placement (the freshly initialised state); `round_metrics` one round's
    metric shapes (the compiled round's output)."""
    done = self.latest_round()
    if done is None:
      return None
    check_not_past(self.directory, done, total_rounds)
    state_target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_template)
    template = history_template(round_metrics, done)
    with self._manager() as manager:
      restored = manager.restore(done, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(state_target),
          history=ocp.args.StandardRestore(template)))
    if int(restored.state.round) != done:
      raise DataError(f"checkpoint {self.directory}/{done} holds round "
                        f"{int(restored.state.round)}, not {done}; it is corrupt")
    return Checkpoint(state=restored.state, history=_unknown_where_missing(
        restored.history, template))


def _unknown_where_missing(history: RoundMetrics, template: RoundMetrics) -> RoundMetrics:
  """A restored history with the metric fields its checkpoint was written without (None;
  bytes_up and bytes_down before 2026-12-04) marked unknown: -1 counts, NaN values."""
  def unknown(shaped):
    value = np.nan if np.issubdtype(shaped.dtype, np.inexact) else -1
    return np.full(shaped.shape, value, shaped.dtype)
  return history._replace(**{
      name: unknown(getattr(template, name)) for name in history._fields
      if getattr(history, name) is None and getattr(template, name) is not None})


def check_not_past(directory: str, done: int, total_rounds: int) -> None:
  # A finished run can be extended (--rounds up), never cut short: its rounds are done.
  if done > total_rounds:
    raise ConfigError(f"{directory} holds a run already trained for {done} rounds;"
                      f" --rounds={total_rounds} cannot shorten it (use another --workdir)")


def _write_json_atomically(path: str, document: dict) -> None:
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump(document, f, indent=2, sort_keys=True)
  os.replace(temporary, path)


def holds_a_run(workdir: str) -> bool:
  """Whether a run left results or a checkpoint in `workdir`, not just its settings."""
  checkpoints = os.path.join(workdir, CHECKPOINTS)
  return (os.path.exists(os.path.join(workdir, "results.json")) or
          (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))


def rounds_saved(workdir: str) -> int | None:
  """Rounds done by the latest checkpoint in `workdir`, or None if it holds none."""
  return Checkpointer(os.path.join(workdir, CHECKPOINTS), every=0).latest_round()


# What a run computes is recorded in its workdir's run_config.json, a document that the
# caller builds (fedora_jax/config.py: the config under its schema version); a rerun
# must match it to resume, and `differences(recorded)` says how another record differs.
Differences = Callable[[dict[str, Any]], list[str]]


def read_run_config(workdir: str) -> dict[str, Any] | None:
  """The workdir's run_config.json, or None where there is none."""
  path = os.path.join(workdir, RUN_CONFIG)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path}: cannot read the run's settings ({e})") from None


def check_workdir(workdir: str, document: dict[str, Any], differences: Differences) -> bool:
  """Raises ConfigError if `workdir` holds a run (results or a checkpoint) recorded with
  another identity (`differences` of its record non-empty, or a record of another
  schema_version); returns whether its run_config.json already records this run. Writes
  nothing, so a sweep can check all its runs before training any."""
  recorded = read_run_config(workdir)
  if recorded is None:
    return False
  version = recorded.get("schema_version") if isinstance(recorded, dict) else None
  if version != document["schema_version"]:
    if holds_a_run(workdir):
      raise ConfigError(f"--workdir {workdir} holds a run recorded in another format"
                        f" (run_config.json schema_version {version}, now"
                        f" {document['schema_version']}); convert it with"
                        f" `python scripts/migrate_run_configs.py {workdir}`, or use another"
                        " --workdir")
    return False
  found = differences(recorded)
  if not found:
    return True
  if holds_a_run(workdir):
    raise ConfigError(f"--workdir {workdir} holds a run with other settings: "
                      f"{', '.join(found)}; rerun with its settings or use another --workdir")
  return False


def claim_workdir(workdir: str, document: dict[str, Any], differences: Differences) -> None:
  """Records `document` in workdir/run_config.json, or raises ConfigError if the workdir
  holds a run (results or a checkpoint) with another identity (check_workdir). A run that
  stopped before leaving either (say, a typo caught at start-up) is taken over; the same
  run's record is rewritten (its rounds, where its data sits: what ran last)."""
  check_workdir(workdir, document, differences)
  os.makedirs(workdir, exist_ok=True)
  _write_json_atomically(os.path.join(workdir, RUN_CONFIG), document)


def remove_checkpoints(workdir: str) -> None:
  """Deletes a finished run's checkpoints (--nokeep_checkpoints); its results.json,
  history.npz and timing.json stay, and they are all a finished row is read from. In a
  multi-process run only process 0 deletes, after every process has saved its last."""
  if jax.process_index() == 0:
    shutil.rmtree(os.path.join(workdir, CHECKPOINTS), ignore_errors=True)


def open_run(workdir: str, document: dict[str, Any], differences: Differences, rounds: int,
             checkpoint_every: int, checkpoint_root: str | None = None) -> Checkpointer | None:
  """Claims `workdir` for this run (claim_workdir) and returns its Checkpointer (None:
  checkpoints off).

  Called before any training, so a mismatched workdir or a --rounds below what the
  workdir already holds stops the run at once. `checkpoint_root` (default `workdir`)
  holds the checkpoints: in a multi-process run every process writes its results to its
  own workdir but all of them save into one checkpoint folder, which orbax needs.
  """
  checkpointer = Checkpointer(os.path.join(checkpoint_root or workdir, CHECKPOINTS),
                              checkpoint_every)
  check_workdir(workdir, document, differences)
  done = checkpointer.latest_round()
  if done is not None:  # even with checkpoints off: a shorter run would overwrite it
    check_not_past(workdir, done, rounds)
  claim_workdir(workdir, document, differences)
  return checkpointer if checkpoint_every else None
