"""What every command shares: devices and processes set up before JAX starts, and errors
as one line with a non-zero exit (experiments.main, reproduce and benchmark)."""

import logging
import os
import sys
from typing import Callable

import jax

from experiments import flags as run_flags
from fedora_jax.engine import sharding
from fedora_jax.errors import ConfigError, FedoraError, FieldError

FLAGS = run_flags.FLAGS


def configure_cpu_devices() -> None:
  """One JAX CPU device per core (or --cpu_devices), set before any backend starts.

  Each device then runs its share of the clients on its own core, which beat one device
  using both cores by 1.7x for FEDORA's round on a 2-core CPU (docs/performance.md).
  Left alone: multi-process runs (a process per host or core is the user's layout) and
  an XLA_FLAGS that already sets --xla_force_host_platform_device_count."""
  multi_process = FLAGS.distributed or FLAGS.num_processes is not None
  forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
  if FLAGS.cpu_devices is None and (multi_process or forced):
    return
  try:
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices or sharding.cpu_device_count())
  except RuntimeError as e:  # a backend already started (e.g. in a notebook)
    raise ConfigError(f"--cpu_devices must be set before JAX starts: {e}") from None


def initialize_distributed() -> None:
  """Starts jax.distributed when asked to, before anything touches a device."""
  explicit = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ConfigError("--coordinator_address, --num_processes and --process_id go"
                      " together (or use --distributed alone for auto-detection)")
  if FLAGS.num_processes is not None and FLAGS.process_id >= FLAGS.num_processes:
    raise ConfigError(f"--process_id={FLAGS.process_id} must be below"
                      f" --num_processes={FLAGS.num_processes}")
  if FLAGS.distributed or FLAGS.num_processes is not None:
    sharding.initialize_distributed(*explicit)


def shutdown_distributed() -> None:
  """Leaves a multi-process run together with the other processes (a no-op otherwise)."""
  if jax.process_count() > 1:
    jax.distributed.shutdown()


def run_command(argv, run_fn: Callable[[], object], interrupted: str = "interrupted",
                log_level: int = logging.INFO) -> None:
  """Runs `run_fn` as a command: one-line errors and a non-zero exit, never a traceback
  unless --verbose."""
  if len(argv) > 1:
    print(f"error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
    sys.exit(1)
  logging.getLogger("fedora_jax").setLevel(log_level)
  try:
    configure_cpu_devices()
    initialize_distributed()
    run_fn()
    shutdown_distributed()
  except FieldError as e:
    print(f"error: {run_flags.as_flag_error(e)}", file=sys.stderr)
    sys.exit(1)
  except FedoraError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt:
    print(f"error: {interrupted}", file=sys.stderr)
    sys.exit(130)
  except Exception as e:  # pylint: disable=broad-except
    if FLAGS.verbose:
      raise
    print(f"error: unexpected {type(e).__name__}: {e} (run with --verbose for the"
          " traceback)", file=sys.stderr)
    sys.exit(2)
