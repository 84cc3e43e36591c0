"""User-facing errors: each one is printed as a single line by the CLI."""

import jax


class FedoraError(Exception):
  """Base class of the errors a user can cause (bad flags, bad data files)."""


class ConfigError(FedoraError):
  """An invalid flag value or combination."""


class FieldError(ConfigError):
  """A config field holds a bad value. The message names the field (`fedprox: mu must be
  >= 0, got -1`); the command line rewrites it as the flag that sets the field
  (`--fedprox_mu must be >= 0, got -1`), so the library never needs to know its flags."""

  def __init__(self, owner: str, field: str, problem: str):
    self.owner, self.field, self.problem = owner, field, problem
    super().__init__(f"{owner}: {field} {problem}")


def check_one_of(owner: str, config, field: str, allowed) -> None:
  """FieldError unless `config.<field>` is one of `allowed` (a config's string choices)."""
  value = getattr(config, field)
  if value not in allowed:
    raise FieldError(owner, field, f"must be one of {', '.join(allowed)}, got {value!r}")


def traced(value) -> bool:
  """Whether `value` is traced, a hyperparameter differing between the runs of one
  program (fedora_jax/batch.py): a config's checks skip it, batch.py having checked
  every run's own value before tracing."""
  return isinstance(value, jax.core.Tracer)


class DataError(FedoraError):
  """A data file is missing, truncated or corrupt, or a partition is impossible."""


class TrainingDivergedError(FedoraError):
  """NaN or Inf appeared in training."""


class RunInterrupted(KeyboardInterrupt):
  """Ctrl-C during a run; the message says where and what is kept to resume from."""
