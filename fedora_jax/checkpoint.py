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
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from fedora_jax.algorithms import REFERENCE
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


def _differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
  keys = sorted(set(recorded) | set(current))
  return [f"{k}={recorded.get(k)!r} (now {current.get(k)!r})" for k in keys
          if recorded.get(k) != current.get(k)]


def _write_json_atomically(path: str, document: dict) -> None:
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump(document, f, indent=2, sort_keys=True)
  os.replace(temporary, path)


# What a run computes (run_config.json) is the flat dict of its settings, by their
# command-line names, reduced by the rules below; a rerun must match it to resume.
#
# Settings that change nothing a run computes, so a workdir may be resumed with other
# values. `rounds` may grow: a round's randomness depends only on the seed and the round
# number and there is no schedule, so a longer run extends a shorter one exactly (cutting
# a run short is refused by open_run). `reference` only changes what R-Acc compares with;
# `eval_every` only which rounds' test scores the history holds.
# Settings that change no number a run computes: neither recorded nor compared. data_dir:
# where the data sits (its files are checked when read), so moving it keeps a workdir.
NOT_IDENTITY = ("workdir", "data_dir", "rounds", "reference", "log_every", "eval_every",
                "checkpoint_every", "keep_checkpoints", "stall_timeout", "compile_timeout",
                "help_algorithm", "per_client",
                "verbose", "distributed",
                "coordinator_address", "num_processes", "process_id", "cpu_devices")
# Settings whose default changed, and the value a run recorded before the change ran with.
# run_config.json records every identity setting's value, default or not, so such a run
# holds the old value and is refused by the new default (never resumed as the other
# variant); this entry keeps that true even for a record that lacks the setting.
# eval_batch_size was 1024 for every model until 2026-11-26 (now unset: 64 for the CNNs
# on CPUs); a recorded 1024 counts as unset, so older runs resume: the chunking changes
# only the rounding of the evaluation sums.
ABSENT_MEANS = {"fedora_variant": "paper",  # the default until 2026-11-26
                "eval_batch_size": 1024}
# Left out of the identity when unset (None), so runs from before they existed resume.
OPTIONAL = ("partition", "classes_per_client", "dirichlet_alpha", "min_client_size",
            "fixed_train_size", "fixed_val_size", "client_chunk", "eval_batch_size", "split",
            "val_fraction", "data_fraction", "client_weights")


def identity_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
  """Each identity setting's default (from setting -> default): at its default a setting
  counts as absent when a workdir's recorded run is compared (check_workdir), so runs
  recorded before a setting was added still resume; a setting whose default changed
  counts as absent at its old value (ABSENT_MEANS)."""
  return {name: ABSENT_MEANS.get(name, default) for name, default in defaults.items()
          if name not in NOT_IDENTITY}


def run_identity(settings: dict[str, Any], algorithm: str, owner_of: dict[str, str],
                 plugin_settings: dict[str, tuple[str, ...]]) -> dict[str, Any]:
  """What a run of `algorithm` with `settings` (name -> value as given, not resolved, so
  an explicit default reads as a different run: refused, never mixed) computes.

  `owner_of` names the algorithm each hyperparameter setting belongs to: only the chosen
  algorithm's own group counts. `plugin_settings`: plug-in switch -> its settings (ala ->
  ala_*, aggregation -> confree_*), which count only when the plug-in is on (ALA's
  settings always for fedala, whose own they are); LOCAL takes no plug-in.
  """
  identity = {k: v for k, v in settings.items() if k not in NOT_IDENTITY}
  identity["algorithm"] = algorithm
  switched_on = {"ala": bool(settings.get("ala")),
                 "aggregation": settings.get("aggregation") not in (None, "mean"),
                 "attack": settings.get("attack") not in (None, "none"),
                 "dp": any(settings.get(name) is not None
                           for name in plugin_settings.get("dp", ()))}
  for switch, names in plugin_settings.items():
    if switched_on.get(switch) and algorithm != REFERENCE:
      continue
    identity.pop(switch, None)
    for name in names:
      if owner_of.get(name) != algorithm:
        identity.pop(name, None)
  if identity.get("data_source") == "files":  # the default: earlier runs keep their identity
    identity.pop("data_source")
  if algorithm == REFERENCE:  # LOCAL averages nothing: one run serves either weighting
    identity.pop("client_weights", None)
  for name in OPTIONAL:
    if identity.get(name) is None:
      identity.pop(name, None)
  plugin_names = {n for names in plugin_settings.values() for n in names}
  return {k: v for k, v in identity.items()
          if owner_of.get(k, algorithm) == algorithm or k in plugin_names}


def holds_a_run(workdir: str) -> bool:
  """Whether a run left results or a checkpoint in `workdir`, not just its settings."""
  checkpoints = os.path.join(workdir, CHECKPOINTS)
  return (os.path.exists(os.path.join(workdir, "results.json")) or
          (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))


def rounds_saved(workdir: str) -> int | None:
  """Rounds done by the latest checkpoint in `workdir`, or None if it holds none."""
  return Checkpointer(os.path.join(workdir, CHECKPOINTS), every=0).latest_round()


def _without_defaults(identity: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in identity.items() if k not in defaults or v != defaults[k]}


def check_workdir(workdir: str, identity: dict[str, Any],
                  defaults: dict[str, Any] | None = None) -> bool:
  """Raises ConfigError if `workdir` holds a run (results or a checkpoint) recorded with
  another identity; returns whether its run_config.json already records this one.
  Writes nothing, so a sweep can check all its runs before training any (reproduce).
  `defaults` (flag -> default value): an entry at its default counts as absent, so a run
  recorded before a flag existed still matches a run that leaves that flag at its
  default."""
  path = os.path.join(workdir, RUN_CONFIG)
  current = json.loads(json.dumps(identity))  # as it reads back: tuples become lists
  defaults = json.loads(json.dumps(defaults or {}))
  try:
    with open(path) as f:
      recorded = json.load(f)
  except FileNotFoundError:
    return False
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path}: cannot read the run's settings ({e})") from None
  # A record made before a setting left the identity (data_dir) still matches.
  recorded = {k: v for k, v in recorded.items() if k not in NOT_IDENTITY}
  if _without_defaults(recorded, defaults) == _without_defaults(current, defaults):
    return True
  if holds_a_run(workdir):
    differences = _differences({**defaults, **recorded}, {**defaults, **current})
    raise ConfigError(f"--workdir {workdir} holds a run with other settings: "
                      f"{', '.join(differences)}; rerun with its flags"
                      " or use another --workdir")
  return False


def claim_workdir(workdir: str, identity: dict[str, Any],
                  defaults: dict[str, Any] | None = None) -> None:
  """Records `identity` in workdir/run_config.json, or raises ConfigError if the workdir
  holds a run (results or a checkpoint) with another identity (check_workdir). A run that
  stopped before leaving either (say, a typo caught at start-up), or a workdir made before
  run_config.json existed, is taken over."""
  if check_workdir(workdir, identity, defaults):
    return
  os.makedirs(workdir, exist_ok=True)
  _write_json_atomically(os.path.join(workdir, RUN_CONFIG), json.loads(json.dumps(identity)))


def remove_checkpoints(workdir: str) -> None:
  """Deletes a finished run's checkpoints (--nokeep_checkpoints); its results.json,
  history.npz and timing.json stay, and they are all a finished row is read from. In a
  multi-process run only process 0 deletes, after every process has saved its last."""
  if jax.process_index() == 0:
    shutil.rmtree(os.path.join(workdir, CHECKPOINTS), ignore_errors=True)


def open_run(workdir: str, identity: dict[str, Any], rounds: int,
             checkpoint_every: int, checkpoint_root: str | None = None,
             defaults: dict[str, Any] | None = None) -> Checkpointer | None:
  """Claims `workdir` for this run and returns its Checkpointer (None: checkpoints off).

  Called before any training, so a mismatched workdir or a --rounds below what the
  workdir already holds stops the run at once. `checkpoint_root` (default `workdir`)
  holds the checkpoints: in a multi-process run every process writes its results to its
  own workdir but all of them save into one checkpoint folder, which orbax needs.
  `defaults`: see `claim_workdir`.
  """
  claim_workdir(workdir, identity, defaults)
  checkpointer = Checkpointer(os.path.join(checkpoint_root or workdir, CHECKPOINTS),
                              checkpoint_every)
  done = checkpointer.latest_round()
  if done is not None:  # even with checkpoints off: a shorter run would overwrite it
    check_not_past(workdir, done, rounds)
  return checkpointer if checkpoint_every else None
