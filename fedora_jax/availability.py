"""Clients as they really are: dropout, availability traces, stragglers and a deadline.

Each round, after `rounds.sampled_clients` has picked who takes part, every sampled
client's fate is drawn from the round key (`draw`), one [K] mask or value per client:

  * dropout (`client_dropout` p): the client drops before uploading, with probability p
    (uniform draws from fold_in(round_key, K + 1));
  * an availability trace (`availability_trace`, a [rounds x K] 0/1 file, `load_trace`):
    a client marked 0 in round r's row is offline that round; sampled, it drops and
    receives nothing;
  * stragglers (`stragglers` f, `straggler_speed`): each client is a straggler with
    probability f, with a speed s drawn from the speed distribution ("uniform:LO,HI" or a
    fixed fraction "S"; others have s = 1; from fold_in(round_key, K + 2)). Without a
    deadline a straggler completes only the first max(1, floor(s T)) of its T local SGD
    steps (FedProx's partial work; engine/local_training.py `step_budget`) and uploads
    what it has;
  * a round deadline (`round_deadline` D, in units of a full client's local-training
    time): the server takes only finished work. A client of speed s needs 1/s units, so
    one with s D < 1 drops (FedProx's FedAvg baseline drops such stragglers); those that
    meet it train all their steps.

The streams K + 1 and K + 2 are ones no client key (0 .. K-1) or the sampling (K) uses,
so with every option off a run is the same program, and for a seed the same clients drop
in the same rounds whatever the algorithm. rounds.py turns a dropped client into one that
was not sampled: its state does not advance, it uploads nothing and weighs 0.
"""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedora_jax.errors import ConfigError, FieldError


class SpeedDistribution(NamedTuple):
  """A straggler's speed, uniform in [low, high] (a fixed speed: low == high)."""
  low: float
  high: float


DEFAULT_SPEED = "uniform:0.1,1"


def parse_speed(text: str) -> SpeedDistribution:
  """"uniform:LO,HI" (0 < LO <= HI <= 1) or a fixed fraction "S" in (0, 1]."""
  def bad(problem: str) -> FieldError:
    return FieldError("train", "straggler_speed",
                      f"must be uniform:LO,HI or a fraction S, 0 < LO <= HI <= 1 and"
                      f" 0 < S <= 1; {problem}")
  kind, _, rest = text.partition(":")
  try:
    if kind == "uniform" and rest:
      low, high = (float(v) for v in rest.split(","))
    elif not rest:
      low = high = float(kind)
    else:
      raise bad(f"got {text!r}")
  except ValueError:
    raise bad(f"got {text!r}") from None
  if not 0.0 < low <= high <= 1.0:
    raise bad(f"got {text!r}")
  return SpeedDistribution(low, high)


class ClientConditions(NamedTuple):
  """A run's client conditions (static). `trace`: [rows, K] bool, round r reads row
  r mod rows; None: every client online every round."""
  dropout: float = 0.0
  trace: np.ndarray | None = None
  stragglers: float = 0.0
  speed: SpeedDistribution = parse_speed(DEFAULT_SPEED)
  deadline: float = 0.0  # 0: none

  @property
  def partial_work(self) -> bool:
    """Whether stragglers train a fraction of their steps (no deadline to drop them)."""
    return self.stragglers > 0 and self.deadline == 0


def check_settings(dropout: float, stragglers: float, speed: str, deadline: float,
                   trace: str | None = None) -> None:
  """One-line ConfigErrors for values no run can take (before any data is read)."""
  if not 0.0 <= dropout < 1.0:
    raise FieldError("train", "client_dropout", f"must be in [0, 1), got {dropout}")
  if not 0.0 <= stragglers <= 1.0:
    raise FieldError("train", "stragglers", f"must be in [0, 1], got {stragglers}")
  distribution = parse_speed(speed)
  if deadline < 0:
    raise FieldError("train", "round_deadline", f"must be >= 0 (0: none), got {deadline}")
  fastest = distribution.high if stragglers == 1.0 else 1.0
  if deadline and deadline * fastest < 1.0:
    raise FieldError("train", "round_deadline",
                     f"of {deadline:g} can be met by no client: the fastest needs"
                     f" {1.0 / fastest:g} (in units of a full client's local-training time)")
  if trace is not None and not os.path.isfile(trace):
    raise ConfigError(f"--availability_trace {trace}: no such file")


def load_trace(path: str, num_clients: int) -> np.ndarray:
  """A [rounds x K] availability trace: a .npy array, or a text file of one row per
  round, K entries 0 or 1 separated by spaces or commas (lines starting # skipped)."""
  def bad(problem: str) -> ConfigError:
    return ConfigError(f"--availability_trace {path}: {problem}")
  try:
    if path.endswith(".npy"):
      trace = np.load(path, allow_pickle=False)
    else:
      with open(path) as f:
        rows = [line.replace(",", " ").split() for line in f
                if line.strip() and not line.lstrip().startswith("#")]
      trace = np.array([[float(v) for v in row] for row in rows]) if rows else np.zeros((0,))
  except (OSError, ValueError) as e:
    raise bad(f"cannot read a 0/1 table ({e})") from None
  if trace.ndim != 2 or trace.shape[0] == 0:
    raise bad(f"must be a [rounds x {num_clients}] table, one row a round; got shape"
              f" {trace.shape}")
  if trace.shape[1] != num_clients:
    raise bad(f"has {trace.shape[1]} columns, but the run has {num_clients} clients")
  if not np.isin(trace, (0, 1)).all():
    raise bad("holds values other than 0 and 1")
  return trace.astype(bool)


def build_conditions(dropout: float = 0.0, trace: str | None = None,
                     stragglers: float = 0.0, speed: str = DEFAULT_SPEED,
                     deadline: float = 0.0, num_clients: int = 0) -> ClientConditions | None:
  """The run's ClientConditions, checked (the trace read for `num_clients` clients); None
  where every option is off, so the round is the same program as without them."""
  check_settings(dropout, stragglers, speed, deadline, trace)
  if not (dropout or trace or stragglers or deadline):
    return None
  return ClientConditions(dropout=dropout,
                          trace=None if trace is None else load_trace(trace, num_clients),
                          stragglers=stragglers, speed=parse_speed(speed),
                          deadline=deadline)


class RoundFate(NamedTuple):
  """What happens to each client [K] this round, sampled or not."""
  online: jax.Array   # bool: reachable (the trace); an offline client receives nothing
  arrives: jax.Array  # bool: online, not dropped out, and in by the deadline
  speed: jax.Array    # float32: the fraction of its local steps it completes (1: all)


def draw(conditions: ClientConditions, round_key: jax.Array, round_index: jax.Array,
         num_clients: int) -> RoundFate:
  """Every client's fate this round, from the round key (and the trace's row)."""
  online = jnp.ones(num_clients, bool)
  if conditions.trace is not None:
    trace = jnp.asarray(conditions.trace)
    online = trace[round_index % trace.shape[0]]
  arrives = online
  if conditions.dropout:
    drops = jax.random.uniform(jax.random.fold_in(round_key, num_clients + 1),
                               (num_clients,)) < conditions.dropout
    arrives = arrives & ~drops
  speed = jnp.ones(num_clients, jnp.float32)
  if conditions.stragglers:
    which_key, speed_key = jax.random.split(jax.random.fold_in(round_key, num_clients + 2))
    straggles = jax.random.uniform(which_key, (num_clients,)) < conditions.stragglers
    low, high = conditions.speed
    drawn = jax.random.uniform(speed_key, (num_clients,), jnp.float32, low, high)
    speed = jnp.where(straggles, drawn if high > low else jnp.float32(low), 1.0)
  if conditions.deadline:
    # Finished work only: a client needs 1 / speed units; with s D < 1 it is late.
    arrives = arrives & (speed * conditions.deadline >= 1.0)
    speed = jnp.ones_like(speed)
  return RoundFate(online=online, arrives=arrives, speed=speed)
