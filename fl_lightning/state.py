"""Where a method keeps what outlives a client: the server's state in one container, and the
working copies of models a client uses for a while (a frozen teacher, a previous model, a personal
model) in one place that is never saved.

- `ServerState` holds everything the server carries from round to round besides the global model
  (`self.model`): SCAFFOLD's c, FedDyn's h, FedExP's iterate, MOON's initial model, prototypes,
  server-trained modules (FedGen's generator, FedTGP/FedORGP's prototype network, FedGH's head).
  It is a submodule of the method, so Lightning moves it to the device with the method, converts
  it with the precision plugin, and every checkpoint holds it in the state_dict: the same way for
  every method, with nothing to save or restore by hand. A method declares each entry once in
  `__init__` and changes it only through the server step's result (`ServerUpdate.server_state`).
- `WorkingCopies` holds modules a client uses but that belong to no one's state: they are built
  from a template once, loaded with whatever state is needed, and never registered as submodules
  (so they are in no checkpoint and no optimizer, and resuming into a fresh instance finds no
  unexpected keys).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

State = dict[str, torch.Tensor]


def to_cpu(tensors: Mapping[str, torch.Tensor]) -> State:
    """A detached CPU copy: per-client state must not hold accelerator memory for clients that wait."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def trainable_zeros(model: nn.Module) -> State:
    return {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}


def _escaped(name: str) -> str:
    # buffer names cannot contain "." (parameter names of a model do); the group keeps the originals
    return name.replace(".", "__")


class _TensorGroup(nn.Module):
    """Named tensors (e.g. one per model parameter) as buffers, read back under their own names."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        super().__init__()
        self.names = list(tensors)
        for name, value in tensors.items():
            self.register_buffer(_escaped(name), value.detach().clone())

    def as_dict(self) -> State:
        return {name: getattr(self, _escaped(name)) for name in self.names}

    def assign(self, values: Mapping[str, torch.Tensor]) -> None:
        if set(values) != set(self.names):
            raise KeyError(f"server state group expects {sorted(self.names)}, got {sorted(values)}")
        for name, value in values.items():
            current = getattr(self, _escaped(name))
            setattr(self, _escaped(name), value.detach().to(device=current.device, dtype=current.dtype).clone())


class ServerState(nn.Module):
    """The server's state between rounds (see the module docstring). Entries are declared with
    `tensors` (named tensors, e.g. one per parameter), `tensor` (one tensor) or `module` (a module
    the server trains), read with `server[name]` (a dict of tensors, a tensor or the module) and
    replaced with `assign({name: new value})`, which the round callback calls with the server
    step's result: a dict for `tensors`, a tensor for `tensor` (its shape may change; it keeps the
    device and dtype of the entry), a state_dict for `module`."""

    def __init__(self):
        super().__init__()
        self.kinds: dict[str, str] = {}  # entry name -> "tensors", "tensor" or "module", in declaration order

    def tensors(self, name: str, values: Mapping[str, torch.Tensor]) -> None:
        self.add_module(name, _TensorGroup(values))
        self.kinds[name] = "tensors"

    def tensor(self, name: str, value: torch.Tensor) -> None:
        self.register_buffer(name, value.detach().clone())
        self.kinds[name] = "tensor"

    def module(self, name: str, module: nn.Module) -> None:
        self.add_module(name, module)
        self.kinds[name] = "module"

    def __getitem__(self, name: str):
        kind = self.kinds.get(name)
        if kind is None:
            raise KeyError(f"no server state entry '{name}'")
        entry = getattr(self, name)
        return entry.as_dict() if kind == "tensors" else entry

    def __contains__(self, name: str) -> bool:
        return name in self.kinds

    def entries(self) -> list[str]:
        return list(self.kinds)

    def assign(self, values: Mapping[str, object]) -> None:
        for name, value in values.items():
            kind = self.kinds.get(name)
            if kind == "tensor":
                current = getattr(self, name)
                self.register_buffer(name, value.detach().to(device=current.device, dtype=current.dtype).clone())
            elif kind == "tensors":
                getattr(self, name).assign(value)
            elif kind == "module":
                getattr(self, name).load_state_dict(value)
            else:
                raise KeyError(f"no server state entry '{name}'")

    def tensors_of(self, values: Mapping[str, object]) -> list[torch.Tensor]:
        """Every tensor of a would-be `assign` (checked for NaN/inf before it is applied)."""
        out = []
        for value in values.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, Mapping):
                out.extend(v for v in value.values() if isinstance(v, torch.Tensor))
        return out


class WorkingCopies:
    """Modules a client uses for a while (see the module docstring): `get(name, template, state)`
    returns the copy called `name`, built from `template` the first time, on `device`, loaded with
    `state` (a state_dict), frozen and in eval mode unless `trainable`."""

    def __init__(self):
        self._copies: dict[str, nn.Module] = {}

    def get(self, name: str, template: nn.Module, state: Mapping[str, torch.Tensor] | None,
            device: torch.device | str, trainable: bool = False) -> nn.Module:
        model = self._copies.get(name)
        if model is None:
            model = self._copies[name] = copy.deepcopy(template)
        model.to(device)
        if state is not None:
            model.load_state_dict(state)
        model.requires_grad_(trainable)
        return model.train(trainable)

    def __getitem__(self, name: str) -> nn.Module:
        return self._copies[name]

    def __contains__(self, name: str) -> bool:
        return name in self._copies
