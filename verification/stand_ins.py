"""Stand-ins for modules that verification/long.py's imports pull in but check (b) never
calls, where they are not installed: a lent GPU machine may have PyTorch and JAX without
scikit-learn, h5py or dp-accounting. Each attribute of a stand-in is a function that
raises when called, so a call that does happen says so instead of passing silently.
Importing this module installs them (STOOD_IN: the modules stood in for)."""

import importlib.machinery
import importlib.util
import sys
import types


def installed(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ValueError:  # in sys.modules without a spec (None: an import refused)
    return False


class StandIn(types.ModuleType):
  """A module that is not installed, where only importing it is needed: each of its
  attributes is a function that raises when called."""

  def __getattr__(self, attribute: str):
    if attribute.startswith("__"):
      raise AttributeError(attribute)
    name = f"{self.__name__}.{attribute}"

    def absent(*args, **kwargs):
      raise RuntimeError(f"{name}: not installed, only a stand-in was imported")
    return absent


# Imported where check (b) never calls them: PFLlib's AUC (scikit-learn) and result files
# (h5py), our DP plug-in's accounting (dp-accounting, imported by the algorithm
# registry). A lent GPU machine may have PyTorch and JAX without them.
ABSENT_OK = ("sklearn", "sklearn.preprocessing", "sklearn.metrics", "h5py", "dp_accounting",
             "dp_accounting.pld", "dp_accounting.rdp")


def install(names: tuple[str, ...] = ABSENT_OK) -> list[str]:
  """StandIns for the modules of `names` whose package is not installed; returns them."""
  absent_packages = {n.split(".")[0] for n in names if not installed(n.split(".")[0])}
  stood_in = []
  for name in names:
    if name.split(".")[0] not in absent_packages:
      continue
    module = StandIn(name)
    # A spec without an origin: PyTorch's dynamo asks find_spec for some of these.
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:  # `from sklearn import metrics` reads the package's attribute
      setattr(sys.modules[parent], child, module)
    stood_in.append(name)
  return stood_in


STOOD_IN = install()
