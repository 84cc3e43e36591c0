"""Bytes sent and received: each algorithm's real messages, counted from their shapes.

A round's messages are pytrees whose sizes are known when the round is traced:
  down  what `broadcast` returns, leaves [K, ...]: client k receives row k (where every
        client gets the same model, one copy of it, not the K-stack the engine holds);
  up    the `upload` of a client's ClientOutput, plus `Algorithm.state_upload` of its new
        state where the server reads client state rather than an upload (FEDORA's and
        FedFomo's models).
So the bytes per client are static (`per_client_bytes`); a round multiplies them by who
took part: down for every sampled client that is online, up for every client whose
upload arrived (rounds.py). The totals are in results.json (`bytes_up`, `bytes_down`),
per round in rounds.csv and TensorBoard, per client and round in history.npz.
docs/communication.md lists what each algorithm's messages hold.
"""

import math

import jax
import numpy as np
from jax.typing import ArrayLike

# Per-client byte counts are int32 in the round's metrics (exact; 2 GiB at most).
MAX_CLIENT_BYTES = np.iinfo(np.int32).max


def per_client_bytes(stacked) -> int:
  """Bytes of one client's row of a pytree whose leaves are [K, ...] (or [S, ...] slots):
  the sum over leaves of prod(shape[1:]) * itemsize. Shapes only: works on tracers."""
  total = sum(math.prod(leaf.shape[1:]) * np.dtype(leaf.dtype).itemsize
              for leaf in jax.tree.leaves(stacked))
  if total > MAX_CLIENT_BYTES:
    raise ValueError(f"one client's message of {total} bytes exceeds the int32 counters"
                     " of the round's metrics")
  return int(total)


def round_totals(per_client: ArrayLike) -> np.ndarray:
  """[R] bytes of each round from the history's [R, K] per-client bytes, in int64."""
  return np.asarray(per_client, np.int64).sum(axis=-1)


def run_total(per_client: ArrayLike | None) -> int | None:
  """All rounds' bytes (None: the history holds no count, or an unknown one, -1, from a
  checkpoint written before bytes were counted)."""
  if per_client is None or (np.asarray(per_client) < 0).any():
    return None
  return int(round_totals(per_client).sum())
