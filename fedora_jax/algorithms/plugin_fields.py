"""What a host algorithm declares so that a plug-in can wrap it.

A plug-in never looks at its host's name: ALA (ala.py) reads `Algorithm.ala_hooks`, where
the host keeps the global model it sends and what its client trains; ConFREE (confree.py)
reads `Algorithm.shared_part`, where the host's server keeps the part its clients upload;
DP (dp.py) reads `Algorithm.upload_mean`, where the host's server keeps the model its
clients receive, from a host that reads their uploads only through their mean.
A host takes a plug-in by declaring the field (None: it does not).
"""

from typing import Any, Callable, NamedTuple

PyTree = Any


class AlaHooks(NamedTuple):
  """Where a host keeps the model ALA works on.

  The received model may be all of the model or some of its layers (FedRep's body): W
  covers the top p layers of what the host sends, theta_hat has the received layers, and
  `initial` says which model the host's training then starts from; W learns on that
  model's loss (the paper's Eq. 1: the loss of the initialised local model).
  """
  received: Callable[[PyTree], PyTree]                       # message -> global model
  # (state, message, theta_hat) -> (state, message)
  replace: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
  trained: Callable[[Any], PyTree]      # the client's ClientOutput -> its next theta_i
  personal_is_local: bool  # evaluate theta_i (hosts whose own personal model is the global one)
  # (host state, theta_i, theta_hat, host's key) -> the model the host trains from; None:
  # theta_i with the received layers replaced by theta_hat's (theta_hat itself when the
  # host sends the whole model).
  initial: Callable[[PyTree, PyTree, PyTree, Any], PyTree] | None = None


def model_message(personal_is_local: bool) -> AlaHooks:
  """A host whose message is the global model and whose upload is its local training.

  FedALA's recipe (TsingZ0/FedALA README, "How to use"): ALA takes the place of the
  client's copy of the received global model into the model it trains, so theta_i is
  the model the client trained, as it holds it when the next global model arrives."""
  return AlaHooks(received=lambda message: message,
                  replace=lambda state, message, start: (state, start),
                  trained=lambda out: out.upload, personal_is_local=personal_is_local)


class SharedPart(NamedTuple):
  """Where a host keeps theta_g, the part ConFREE and the robust aggregators aggregate
  (and the attackers of byzantine.py poison)."""
  of_server: Callable[[PyTree], PyTree]          # server state -> theta_g
  of_uploads: Callable[[PyTree], PyTree]         # uploads -> the clients' theta_i [K, ...]
  replace: Callable[[PyTree, PyTree], PyTree]    # (server state, new theta_g) -> state
  # (uploads, new theta_i [K, ...]) -> uploads; None: the uploads cannot be rewritten.
  replace_uploads: Callable[[PyTree, PyTree], PyTree] | None = None


WHOLE_SERVER = SharedPart(of_server=lambda server: server,
                          of_uploads=lambda uploads: uploads,
                          replace=lambda server, shared: shared,
                          replace_uploads=lambda uploads, shared: shared)
# A server state with a `body` field, the feature extractor its clients upload.
BODY = SharedPart(of_server=lambda server: server.body,
                  of_uploads=lambda uploads: uploads.body,
                  replace=lambda server, shared: server._replace(body=shared),
                  replace_uploads=lambda uploads, shared: uploads._replace(body=shared))


class UploadMean(NamedTuple):
  """A host whose server reads its clients' uploads only through their weighted mean and
  keeps nothing else of theirs (FedAvg-like): a plug-in may hand it another estimate of
  that mean, as identical uploads (DP, dp.py: the noised mean of clipped updates). Every
  upload is shaped as `received(server)`, the model the clients were sent (`sent` finds
  it in one client's message), so a client's update is its upload minus that."""
  received: Callable[[PyTree], PyTree]           # server state -> the model sent
  sent: Callable[[PyTree], PyTree]               # one client's message -> that model


# A host whose server state is the model it sends and its clients upload.
SERVER_MODEL = UploadMean(received=lambda server: server, sent=lambda message: message)
