"""Times rounds with the clients held on the host (--client_data=host).

run_host (fedora_jax/host_simulation.py) for --warmup + --repeats rounds and a last one:
the median seconds of the timed rounds (each: the sampled clients trained, the
--eval_clients sample scored, the next round's clients generated and moved on a worker
thread meanwhile), the last round's seconds on their own (it scores every client), the
compile seconds (the first round's data, model and algorithm init, the jit of the round
is in the first round, which warmup leaves out) and the process's peak RSS.
"""

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

from benchmarks.measure import peak_rss_bytes
from fedora_jax import algorithms
from fedora_jax.data.host_clients import HostClients
from fedora_jax.host_simulation import run_host
from fedora_jax.rounds import num_sampled_clients
from fedora_jax.simulation import TrainConfig


def round_durations(stamps: list[float], start: float) -> list[float]:
  """Seconds of each round from the times its metrics came back (`stamps`) and when the
  first round started."""
  return list(np.diff([start] + stamps))


def run_host_benchmark(algorithm: str, algorithm_config: Any, model, clients: HostClients,
                       train: TrainConfig, repeats: int, warmup: int,
                       log: Callable[[str], None]) -> dict:
  """The report of one host-held run of warmup + repeats + 1 rounds."""
  train = dataclasses.replace(train, client_data="host", rounds=warmup + repeats + 1)
  stamps: list[float] = []
  started = time.perf_counter()
  result = run_host(algorithms.make(algorithm, algorithm_config), model, clients, train,
                    on_round=lambda r, metrics: stamps.append(time.perf_counter()),
                    progress=None)
  first_round_start = started + result.compile_seconds
  durations = round_durations(stamps, first_round_start)
  timed = durations[warmup:warmup + repeats]
  log(f"host-held rounds: {', '.join(f'{d:.3f}' for d in durations)} s")
  return {
      "algorithm": algorithm, "num_clients": clients.num_clients, "client_data": "host",
      "clients_trained_per_round": num_sampled_clients(train.participation,
                                                       clients.num_clients),
      "participation": train.participation, "eval_clients": train.eval_clients,
      "round_seconds": float(np.median(timed)), "round_seconds_each": timed,
      "last_round_seconds": durations[-1], "repeats": repeats, "warmup": warmup,
      "compile_seconds": result.compile_seconds,
      "peak_memory_bytes": peak_rss_bytes(),
      "load_average": list(os.getloadavg()),
      "final_mean_val_score": float(np.nanmean(result.history.val_score[-1]))}


def summary(r: dict) -> str:
  return (f"{r['algorithm']}, K={r['num_clients']} held on the host,"
          f" {r['clients_trained_per_round']} trained a round, {r['eval_clients'] or 'all'}"
          f" scored: round {r['round_seconds']:.3f} s (median of {r['repeats']}), the last"
          f" round (every client scored) {r['last_round_seconds']:.1f} s, compile"
          f" {r['compile_seconds']:.1f} s, peak RSS {r['peak_memory_bytes'] / 2**20:.0f} MiB,"
          f" load average {r['load_average'][0]:.1f}")
