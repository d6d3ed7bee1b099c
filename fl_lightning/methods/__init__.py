"""Methods grouped by family (fedsol/, baselines/, frozen/, personalized/, hetero/, server_opt/),
one method (or a closely related pair) per file. Every method class defined in a module of this
package is found here (the package is walked at import) and exported by its class name, so adding
a method is adding one file; the CLI takes any of them by name (`--model FedSOL`)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from fl_lightning.methods.base import FederatedMethod
from fl_lightning.methods.shared_model import SharedModelMethod


def _method_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for info in sorted(pkgutil.walk_packages(__path__, f"{__name__}."), key=lambda i: i.name):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, FederatedMethod) and obj.__module__ == module.__name__:
                if name in found and found[name] is not obj:
                    raise RuntimeError(f"two method classes named {name}: {found[name].__module__} and "
                                       f"{obj.__module__}")
                found[name] = obj
    return found


_METHODS = _method_classes()
globals().update(_METHODS)
from fl_lightning.methods.personalized.knn_per import KNNPerModel  # noqa: E402 - a helper module, not a method

__all__ = ["FederatedMethod", "SharedModelMethod", *sorted(set(_METHODS) - {"FederatedMethod", "SharedModelMethod"}),
           "KNNPerModel"]
