"""What a client sends to the server, what the server step returns, and the server's averaging,
shared by every method.

An upload is named groups of tensors, each group named for what the server does with it:
"weights" (the model tensors the default server step averages), SCAFFOLD's "control_delta"
(summed), the prototype methods' "prototypes" (pooled per class), FedGen's "label_counts" and
FedNova's "local_steps" (which weight or normalise the others), LG-FedAvg's "head" and FML/FedKD's
"shared" (averaged into a server-side module). Within a group a tensor's name is its own (a model's
state_dict key, a class, a parameter's name): no group rides inside another under a key prefix. So
a new kind of upload is a new group, named and read by the method alone, and the round callback
checks every tensor of an upload for NaN/inf, and `RoundUploads` sums any group across processes,
without knowing the method.

The server receives the round's uploads as `RoundUploads`: a list of the uploads of the clients
this process trained, plus reductions over the uploads of every process (`parallel.py` spreads a
round's clients over processes). Averaging is a weighted sum in float64 (each process sums its
own uploads, one all_reduce adds the processes' sums) and a finishing step that divides by the
total weight and casts back to each tensor's dtype; integer buffers (BN's `num_batches_tracked`),
which are not averageable, take the value of the lowest-numbered client's upload. With one
process the same code runs without the collectives, so a run's result does not depend on how
many processes ran it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from fl_lightning.parallel import Collective

WEIGHTS = "weights"  # the group the default server step averages

Group = dict[str, torch.Tensor]


@dataclass
class ClientUpload:
    """One client's message at the end of its local training.

    Attributes:
        client, num_samples: who sent it and how many training samples it holds.
        groups: group name -> {tensor name -> tensor}: everything the server receives (see the
            module docstring). `weights` is the "weights" group: model tensors by their
            state_dict names, which the default server step averages. Scalars the server needs
            (FedNova's step count, FedGen's label counts) travel as tensors in a group of their
            own, so that they are checked, moved and gathered as every other tensor is.
        stats: floats for logging only, never aggregated.
        kept: the client's own persistent state after this round (SCAFFOLD's c_i, FedDyn's g_i,
            MOON's previous model, Ditto's personal model, FedPer/FedRep's head, a heterogeneous
            client's model, FedKD's W_h): never sent, never aggregated. The round callback stores
            it in the client-state store once it has checked the upload (a client whose upload is
            rejected as non-finite keeps its previous state), and clears this field. Its keys
            carry the prefixes the client-state store reads them back by (`client_state`).
    """

    client: int
    num_samples: int
    groups: dict[str, Group] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        for name, tensors in self.groups.items():
            _check_names(name, tensors)

    @property
    def weights(self) -> Group:
        return self.group(WEIGHTS)

    def group(self, name: str) -> Group:
        """The group `name` as the upload holds it, so that writing into it writes into the
        upload; a group the client did not send is added empty."""
        return self.groups.setdefault(name, {})

    def set_group(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Sets (replaces) the group `name`."""
        _check_names(name, tensors)
        self.groups[name] = dict(tensors)

    def all_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the upload carries, and the state the client keeps (finiteness checks)."""
        for tensors in self.groups.values():
            yield from tensors.values()
        yield from self.kept.values()


def _check_names(group: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Tensor names are strings: the reductions across processes match tensors by name, sorted
    (a class label goes as str(c))."""
    if not all(isinstance(k, str) for k in tensors):
        raise TypeError(f"upload group '{group}': tensor names must be strings, got {list(tensors)}")


@dataclass
class ServerUpdate:
    """What a method's server step returns (as Flower's `aggregate_fit` returns parameters and
    metrics): the round callback checks it for NaN/inf, applies it, syncs it and logs it; the
    server step itself changes nothing.

    Attributes:
        global_state: the model every client starts from next round (`self.model`'s new
            state_dict); None for methods without a global model.
        server_state: new values of the method's `ServerState` entries (by entry name), e.g.
            {"c": {...}} for SCAFFOLD; entries not named keep their value.
        metrics: the server step's own figures (e.g. FedNova's tau_eff), logged with the round.
    """

    global_state: dict[str, torch.Tensor] | None = None
    server_state: dict[str, object] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def all_finite(tensors: Mapping[str, torch.Tensor] | ClientUpload) -> bool:
    """True when no floating-point tensor holds NaN/inf; one device sync for all of them.

    A tensor's sum is finite only if every element is (a NaN or inf in it makes the sum NaN or
    inf), and so is a sum of such sums: a finite total settles it without testing every element
    (one reduction instead of a comparison per element); only a total that is not finite (which
    finite elements can give by overflowing) is checked element by element. (One running total
    rather than a stack of the sums: two fewer tensor operations, in a check run after every
    client.)"""
    values = tensors.all_tensors() if isinstance(tensors, ClientUpload) else tensors.values()
    floats = [t for t in values if torch.is_floating_point(t)]
    if not floats:
        return True
    total = floats[0].sum(dtype=torch.float32)  # 16-bit sums would overflow sooner
    for t in floats[1:]:
        total = total + t.sum(dtype=torch.float32)
    if bool(total.isfinite()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in floats]).all())


_WEIGHT = "\0weight"  # the total weight rides in the same reduction as the weighted tensors
_SHORT_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class RoundUploads(list):
    """The round's accepted uploads held by this process, with reductions over every process's.

    Iterating (or indexing) gives this process's uploads: what the server does per client with
    that client's own upload (SCAFFOLD's c_i, FedDyn's g_i, MOON's previous model) happens on the
    process that trained the client, which also keeps that client's state. Whatever the server adds
    up over the round's clients goes through `sum` / `weighted_average`; a server rule that is not
    a sum (prototype pooling, a generator trained on the clients' heads) takes `gathered()`.

    Args:
        uploads: this process's accepted uploads, in client order.
        collective: the processes' collectives (`parallel.Collective`); None = one process.
        device: where results are placed (the module's device).
    """

    def __init__(self, uploads: Iterable[ClientUpload] = (), collective: Collective | None = None,
                 device: torch.device | str | None = None):
        super().__init__(uploads)
        self.collective = collective or Collective()
        self.device = torch.device(device) if device is not None else None

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device is None else t.to(self.device)

    def _agree(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The same keys and shapes on every process (a process whose clients were all skipped, or
        whose clients uploaded fewer keys, contributes zeros)."""
        if not self.collective.distributed:
            return dict(local)
        schema: dict[str, tuple] = {}
        for part in self.collective.gather({k: tuple(v.shape) for k, v in local.items()}):
            schema.update(part)
        return {k: local[k] if k in local else self._place(torch.zeros(shape, dtype=torch.float64))
                for k, shape in sorted(schema.items())}

    def sum(self, terms: str | Callable[[ClientUpload], Mapping[str, torch.Tensor | float]]) -> dict[str, torch.Tensor]:
        """sum over every process's uploads u of terms(u), per key, in float64; `terms` is a
        group's name (sum that group) or a function of an upload."""
        terms = _reader(terms)
        local: dict[str, torch.Tensor] = {}
        for u in self:
            for key, value in terms(u).items():
                self._add(local, key, value)
        return self._reduce(local)

    def _add(self, local: dict[str, torch.Tensor], key: str, value: torch.Tensor | float,
             scale: float | None = None) -> None:
        """local[key] += scale * value, in float64 (in place: the same sum, no new tensor)."""
        value = torch.as_tensor(value).detach()
        if key not in local:
            first = value.to(dtype=torch.float64, copy=True)
            local[key] = self._place(first if scale is None else first.mul_(scale))
        elif scale is None:
            local[key].add_(value.to(torch.float64))
        elif value.dtype in _SHORT_FLOATS and scale.is_integer() and abs(scale) < 2**29:
            # the product of a float32 (or 16-bit) value and an integer below 2^29 is exact in
            # float64, so one fused pass over the value (add with alpha) adds the very number a
            # scaled float64 copy would: the same sum, a third of the memory traffic
            local[key].add_(value, alpha=scale)
        else:
            local[key].add_(value.to(torch.float64, copy=True).mul_(scale))

    def _reduce(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self._place(v) for k, v in self.collective.sum(self._agree(local)).items()}

    def total(self, value: Callable[[ClientUpload], float]) -> float:
        """sum over every process's uploads of a number (e.g. the round's samples)."""
        return float(self.sum(lambda u: {"v": float(value(u))}).get("v", 0.0))

    @property
    def count(self) -> int:
        """The number of accepted uploads of the round, over every process."""
        return round(self.total(lambda u: 1.0))

    def weighted_average(self, values: str | Callable[[ClientUpload], Mapping[str, torch.Tensor]] = WEIGHTS,
                         weight: Callable[[ClientUpload], float] = lambda u: u.num_samples
                         ) -> dict[str, torch.Tensor]:
        """sum_u weight(u) * values(u) / sum_u weight(u) per key over every process's uploads,
        back in each tensor's dtype; integer tensors take the lowest-numbered client's value.
        `values` is a group's name (average that group, by default "weights") or a function of
        an upload."""
        values = _reader(values)
        first = min(self, key=lambda u: u.client, default=None)
        meta = {"dtypes": {}, "ints": None}
        if first is not None:
            tensors = values(first)
            meta["dtypes"] = {k: v.dtype for k, v in tensors.items()}
            meta["ints"] = (first.client, {k: v.detach().cpu() for k, v in tensors.items()
                                           if not torch.is_floating_point(v)})
        parts = self.collective.gather(meta)
        dtypes = {k: d for part in parts for k, d in part["dtypes"].items()}
        ints = min((p["ints"] for p in parts if p["ints"] is not None), key=lambda c: c[0], default=(None, {}))[1]

        local: dict[str, torch.Tensor] = {}
        for u in self:
            w = float(weight(u))
            self._add(local, _WEIGHT, w)
            for k, v in values(u).items():
                if torch.is_floating_point(v):
                    self._add(local, k, v, scale=w)
        sums = self._reduce(local)
        total = float(sums.pop(_WEIGHT, 0.0))
        if total <= 0:
            raise ValueError("weighted_average needs at least one upload with a positive weight")
        averaged = {k: (v / total).to(dtypes[k]) for k, v in sums.items()}
        averaged.update({k: self._place(v.clone()) for k, v in ints.items()})
        return {k: averaged[k] for k in dtypes}  # the uploads' key order

    def gathered(self) -> list[ClientUpload]:
        """Every process's uploads (tensors on this process's device), in client order: for server
        rules that are not weighted sums."""
        if not self.collective.distributed:
            return list(self)
        mine = [_map_tensors(u, lambda t: t.detach().cpu()) for u in self]
        every = [u for part in self.collective.gather(mine) for u in part]
        return sorted((_map_tensors(u, self._place) for u in every), key=lambda u: u.client)


def _reader(values: str | Callable[[ClientUpload], Mapping]) -> Callable[[ClientUpload], Mapping]:
    """A group's name as the function reading that group from an upload."""
    if isinstance(values, str):
        return lambda u: u.group(values)
    return values


def _map_tensors(upload: ClientUpload, fn: Callable[[torch.Tensor], torch.Tensor]) -> ClientUpload:
    return replace(
        upload,
        groups={name: {k: fn(v) for k, v in tensors.items()} for name, tensors in upload.groups.items()},
        kept={k: fn(v) for k, v in upload.kept.items()},
    )
