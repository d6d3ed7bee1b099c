"""What a client sends to the server, and the server's averaging, shared by every method.

An upload says in its type what each tensor is for: `weights` are averaged; control-variate
deltas are summed over the round's clients; prototypes are pooled per class; label counts and
local step counts weight or normalise the others. So nothing rides through the weights under a
key prefix, and the callback can check every tensor of an upload without knowing the method.

Averaging is written as a weighted sum plus a finishing step: the sum is exactly what a
reduction across processes would add (the parallel-clients issue runs a round's clients on
several processes), and the finishing step casts back to each tensor's dtype and keeps integer
buffers (BN's `num_batches_tracked`), which are not averageable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class ClientUpload:
    """One client's message at the end of its local training.

    Attributes:
        client, num_samples: who sent it and how many training samples it holds.
        weights: model tensors the server averages (by name, as in the model's state_dict).
        stats: floats for logging only, never aggregated.
        control_delta: SCAFFOLD's c_i+ - c_i, summed over clients (and divided by N) by the server.
        prototypes: class -> the client's feature prototype (FedProto, FedTGP, FedORGP).
        label_counts: samples per class (FedGen weights the clients' heads by them).
        local_steps: the number of local steps taken (FedNova normalises the update by it).
    """

    client: int
    num_samples: int
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    control_delta: dict[str, torch.Tensor] = field(default_factory=dict)
    prototypes: dict[int, torch.Tensor] = field(default_factory=dict)
    label_counts: torch.Tensor | None = None
    local_steps: int | None = None

    def all_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the upload carries (finiteness checks, byte counts)."""
        yield from self.weights.values()
        yield from self.control_delta.values()
        yield from self.prototypes.values()
        if self.label_counts is not None:
            yield self.label_counts


def all_finite(tensors: Mapping[str, torch.Tensor] | ClientUpload) -> bool:
    """True when no floating-point tensor holds NaN/inf; one device sync for all of them."""
    values = tensors.all_tensors() if isinstance(tensors, ClientUpload) else tensors.values()
    checks = [torch.isfinite(t).all() for t in values if torch.is_floating_point(t)]
    return bool(torch.stack(checks).all()) if checks else True


def weighted_sum(tensors: Sequence[Mapping[str, torch.Tensor]], coefficients: Sequence[float]
                 ) -> dict[str, torch.Tensor]:
    """sum_i c_i x_i per key, accumulated in float32 (float64 stays float64). Integer tensors are
    not summed: they take the first client's value. This is the part a cross-process reduction
    adds up."""
    if not tensors:
        raise ValueError("weighted_sum needs at least one upload")
    out = {}
    for key, first in tensors[0].items():
        if not torch.is_floating_point(first):
            out[key] = first.clone()
            continue
        acc = torch.zeros_like(first, dtype=torch.float64 if first.dtype == torch.float64 else torch.float32)
        for t, c in zip(tensors, coefficients, strict=True):
            acc.add_(t[key].to(acc.dtype), alpha=float(c))
        out[key] = acc
    return out


def finish_average(summed: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The finishing step: every tensor back in the dtype of `like` (e.g. bf16 weights summed in
    float32)."""
    return {k: v.to(like[k].dtype) for k, v in summed.items()}


def weighted_average(tensors: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
                     ) -> dict[str, torch.Tensor]:
    """sum_i p_i x_i with p_i = weights_i / sum(weights), per key: the coefficients are normalised
    first (the total weight is one scalar to agree on), then summed and finished."""
    total = float(sum(weights))
    if not tensors or total <= 0:
        raise ValueError("weighted_average needs at least one upload with a positive weight")
    return finish_average(weighted_sum(tensors, [float(w) / total for w in weights]), tensors[0])
