"""A host's server state with a plug-in's own state beside it.

A plug-in that keeps something across rounds on the server (the attackers' key and round
counter, byzantine.py; centered clipping's previous aggregate, robust.py) wraps the host's
server state as Extended(host, extra). `extend_server` lifts every function of the host
that reads the server to read its own part, and the host's declared shared part to find
it there, so later plug-ins and the engine never see the difference; the plug-in then
replaces the functions that use `extra`.
"""

from typing import Any, Callable, NamedTuple

from fedora_jax.algorithms.base import Algorithm, AlgorithmState, InitContext
from fedora_jax.algorithms.plugin_fields import SharedPart

PyTree = Any


class Extended(NamedTuple):
  host: PyTree    # the host's server state
  extra: PyTree   # the plug-in's


def lift_shared_part(shared: SharedPart | None) -> SharedPart | None:
  """The host's shared part, read from and written to Extended.host."""
  if shared is None:
    return None
  return SharedPart(of_server=lambda server: shared.of_server(server.host),
                    of_uploads=shared.of_uploads,
                    replace=lambda server, new: server._replace(
                        host=shared.replace(server.host, new)),
                    replace_uploads=shared.replace_uploads)


def extend_server(host: Algorithm, init_extra: Callable[[InitContext, AlgorithmState], PyTree],
                  name: str) -> Algorithm:
  """`host` with server state Extended(host's, init_extra(context, host's initial state));
  its aggregate keeps `extra` as it is (the plug-in replaces it where extra changes)."""

  def init(context: InitContext) -> AlgorithmState:
    state = host.init(context)
    return state._replace(server=Extended(state.server, init_extra(context, state)))

  def aggregate(server: Extended, clients, uploads, weights) -> AlgorithmState:
    state = host.aggregate(server.host, clients, uploads, weights)
    return state._replace(server=server._replace(host=state.server))

  shared_model, sampled_broadcast = host.shared_model, host.sampled_broadcast
  return host._replace(
      name=name, init=init, aggregate=aggregate,
      broadcast=lambda server, clients: host.broadcast(server.host, clients),
      sampled_broadcast=(None if sampled_broadcast is None else
                         lambda server, clients, sampled: sampled_broadcast(
                             server.host, clients, sampled)),
      personalized_params=lambda server, clients: host.personalized_params(server.host,
                                                                           clients),
      artifacts=lambda server: host.artifacts(server.host),
      shared_model=(None if shared_model is None else
                    lambda server: shared_model(server.host)),
      shared_part=lift_shared_part(host.shared_part))
