"""ALA on its hosts beside PFLlib: the driver of check (a)'s <host>_ala rows.

Neither the FedALA authors (TsingZ0/FedALA) nor PFLlib ship a host with ALA, so the
reference is composed from their pieces: the host's own PFLlib client, and PFLlib's
utils/ALA.py (the authors' module) applied where PFLlib's clientALA applies it. When the
server's send_models hands the client the global model, the client does not overwrite the
model it trains with it: it calls ALA.adaptive_local_aggregation(global model, its model),
which leaves theta_hat there. Everything else the host's set_parameters does (FedProx's
anchor, FedPHP's round, FedAMP's cloud model) it still does. Which model ALA acts on is
what our host's ala_hooks say (AlaOn, one per host in one_round.py).

Nothing here copies a reference's code: the classes are PFLlib's, subclassed at run time.
"""

import copy
import functools
from typing import Any, Callable, NamedTuple


class AlaOn(NamedTuple):
  """Where ALA acts on a host's PFLlib client (our host's ala_hooks, in its terms)."""
  # client -> the module holding the global model as the host's set_parameters received
  # it (read right after that call, before the client's own model is put back).
  received: Callable[[Any], Any]
  # client -> the module ALA initialises: its parameters are the client's own (ALA writes
  # theta_hat into them).
  local: Callable[[Any], Any]
  # client -> None: the host's other copies of the received model set to theta_hat too
  # (pFedMe's local model w_i starts where its theta does); None: no other copy.
  after: Callable[[Any], None] | None = None


def whole_model(client):
  return client.model


@functools.cache
def _routed_class():
  import torch  # pylint: disable=import-outside-toplevel

  class Routed(torch.nn.Module):
    """A base read through its client's head: ALA's model for a host that sends the
    base alone (FedRep). Its parameters are the base's (ALA's layer_idx counts them);
    its output the head's class scores, the loss W learns on (ours: the whole model's;
    the authors' ALA handed the bare base would take the cross-entropy of its features)."""

    def __init__(self, base, head):
      super().__init__()
      self.base = base
      self.heads = (head,)  # a tuple: not a submodule, so not among parameters()

    def forward(self, x):
      return self.heads[0](self.base(x))
  return Routed


def routed_base(client):
  """The client's base under its own head (Routed), sharing the client's modules."""
  return _routed_class()(client.model.base, client.model.head)


def copy_model_into_local_params(client) -> None:
  """pFedMe's w_i (its local_params) set to theta_hat, as its set_parameters sets it to
  the global model beside its theta."""
  for local, param in zip(client.local_params, client.model.parameters()):
    local.data = param.data.clone()


def anchor_at_theta_hat(client) -> None:
  """FedProx's proximal anchor (its global_params) set to theta_hat too: ours under
  --fedprox_ala_anchor=theta_hat (the fedprox_ala_theta_hat row)."""
  for anchor, param in zip(client.global_params, client.model.parameters()):
    anchor.data = param.data.clone()


@functools.cache
def ala_client(host_class: type, on: AlaOn) -> type:
  """`host_class` whose set_parameters runs ALA in place of its copy into the model it
  trains (`on` says where): the host's own set_parameters runs, the client's model is put
  back as it was (theta_i, as trained last round), and ALA initialises it from the model
  received. The client needs an `ALA` (utils/ALA.py's) set before its first round."""

  class AlaHost(host_class):
    def set_parameters(self, *args):
      own = [param.data.clone() for param in self.model.parameters()]
      super().set_parameters(*args)
      received = copy.deepcopy(on.received(self))
      for param, kept in zip(self.model.parameters(), own):
        param.data = kept
      self.local_initialization(received)
      if on.after is not None:
        on.after(self)

    def local_initialization(self, received_global_model):
      # clientALA's, on the model `on` names.
      self.ALA.adaptive_local_aggregation(received_global_model, on.local(self))

  AlaHost.__name__ = AlaHost.__qualname__ = f"{host_class.__name__}_ALA"
  return AlaHost


def attach(server, train_data: list, on: AlaOn, args: dict) -> None:
  """Each of the server's clients made an ala_client of its class, with its ALA built as
  clientALA builds it (its loss, batch size; `args`: rand_percent, layer_idx, eta) on
  `train_data[k]`, client k's training data as PFLlib's read_client_data gives it."""
  from utils.ALA import ALA  # pylint: disable=import-outside-toplevel
  for client in server.clients:
    client.__class__ = ala_client(type(client), on)
    client.ALA = ALA(client.id, client.loss, train_data[client.id], client.batch_size,
                     args["rand_percent"], args["layer_idx"], args["eta"], client.device)
