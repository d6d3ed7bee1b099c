"""A second device on a machine that has only the CPU, for tests that code keeps its tensors on
the device it was given (a GPU run fails with "Expected all tensors to be on the same device"
where a CPU run cannot).

`SimulatedDevice` is a TorchFunctionMode: every tensor stays in CPU memory, but the mode records
on which device each one would be. A tensor made by a factory (`torch.zeros`, `torch.randn`, ...)
is on the device it names (the CPU if none); `.to(device)`, `.cuda()`, `.cpu()` move it; any
other operation's result is on its inputs' device, and inputs on two devices raise as CUDA does
(a 0-dim CPU tensor mixes with anything, as on CUDA). `tensor.device` answers with the recorded
device, so code that places new tensors "where the model is" is checked too. Tensors the mode
never saw (made before it, or inside autograd) are on no device in particular and mix with any.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.randn, torch.rand, torch.randint, torch.arange,
             torch.linspace, torch.tensor, torch.as_tensor, torch.eye}
SHAPE_OF_OTHER = {torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as}  # only its shape


class SimulatedDevice(TorchFunctionMode):
    def __init__(self, name: str = "cuda"):
        super().__init__()
        self.name = name
        self.placed = WeakIdKeyDictionary()  # tensor -> "cpu" or `name`

    def place(self, *tensors: torch.Tensor) -> None:
        """Records tensors made outside the mode (a model's parameters and buffers) as on the device."""
        for t in tensors:
            self.placed[t] = self.name

    def device_of(self, t: torch.Tensor) -> str | None:
        return self.placed.get(t)

    def _named(self, device) -> str:
        return self.name if torch.device(device).type == self.name else "cpu"

    def _moved(self, func, args, kwargs):
        """(func, args, the device asked for or None) of a factory or a move; `kwargs` loses its device."""
        device = kwargs.pop("device", None)
        if func is torch.Tensor.to:  # .to(device), .to(dtype), .to(other), in any combination
            rest = []
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    device = a
                elif isinstance(a, torch.Tensor):
                    device = self.placed.get(a, "cpu")
                    kwargs.setdefault("dtype", a.dtype)
                else:
                    rest.append(a)
            args = (args[0], *rest)
        elif func is torch.Tensor.cuda:
            func, device, args = torch.Tensor.to, self.name, args[:1]
        elif func is torch.Tensor.cpu:
            device = "cpu"
        return func, args, device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__:
            return torch.device(self.name) if self.placed.get(args[0]) == self.name else func(*args)
        if func in SHAPE_OF_OTHER:
            out = func(*args, **kwargs)
            if args[0] in self.placed:
                self.placed[out] = self.placed[args[0]]
            return out
        target = None
        if func in FACTORIES or func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            func, args, device = self._moved(func, args, kwargs)
            if device is not None:
                target = self._named(device)
            elif func in FACTORIES:
                target = "cpu"
        out = func(*args, **kwargs)
        if target is None:
            target = self._propagated(func, args, kwargs)
        if target is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.placed[t] = target
        return out

    def _propagated(self, func, args, kwargs) -> str | None:
        devices, cpu_scalar = set(), False
        for t in tree_flatten((args, kwargs))[0]:
            device = self.placed.get(t) if isinstance(t, torch.Tensor) else None
            if device == "cpu" and t.dim() == 0:
                cpu_scalar = True
            elif device is not None:
                devices.add(device)
        if len(devices) > 1:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{' and '.join(sorted(devices))}! (in {getattr(func, '__name__', func)})")
        if devices:
            return devices.pop()
        return "cpu" if cpu_scalar else None
