"""Per-step values of local training (a method's `log_local`), kept until the round ends.

A local step's values (its loss, a method's extra terms) are recorded on the device as they are,
with the step's batch size, and read once per round: the round driver takes each client's mean
for its row of the per-client table and, at the round's end, every process's batch-size-weighted
sums, which it merges into the round's logged means (`train/loss`, a method's own terms).
Lightning's `self.log` would aggregate every value at every step, a cost that a small model's
local step would feel.
"""

from __future__ import annotations

import numpy as np
import torch


def _weighted_sum(values: list, sizes: list[int]) -> tuple[float, float]:
    """(sum of value * size, sum of sizes) in float64, with one device sync for all values."""
    stacked = torch.as_tensor([float(v) for v in values], dtype=torch.float64) if not all(
        isinstance(v, torch.Tensor) for v in values) else torch.stack(values).double().cpu()
    # numpy reads a list of ints faster than torch.as_tensor, and the sizes' sum is exact in
    # Python as in float64 (integers)
    weights = torch.from_numpy(np.asarray(sizes, dtype=np.float64))
    return float((stacked * weights).sum()), float(sum(sizes))


class LocalLogs:
    """What `log_local` recorded on this process since the round's last flush: per key, the
    values (tensors stay on the device until read) and the batch size of each.

    A position (`position()`) is the number of records per key at one moment; two positions
    delimit one client's local training, whose means `means(since, until)` gives.
    """

    __slots__ = ("_records",)

    def __init__(self):
        self._records: dict[str, tuple[list, list[int]]] = {}

    def __bool__(self) -> bool:
        return bool(self._records)

    def add(self, metrics: dict[str, torch.Tensor | float], batch_size: int) -> None:
        """Records one step's values, each weighted by `batch_size` in every mean."""
        for key, value in metrics.items():
            values = self._records.setdefault(key, ([], []))
            values[0].append(value.detach() if isinstance(value, torch.Tensor) else value)
            values[1].append(batch_size)

    def flush(self) -> dict[str, tuple[float, float]]:
        """Everything recorded, as {key: (batch-size-weighted sum, total batch size)}, and forgets
        it; `merge` turns such parts (one per process) into means."""
        sums = {key: _weighted_sum(values, sizes) for key, (values, sizes) in self._records.items()}
        self._records = {}
        return sums

    def position(self) -> dict[str, int]:
        """Where the records stand now (for `means` of one client)."""
        return {key: len(values) for key, (values, _) in self._records.items()}

    def means(self, since: dict[str, int], until: dict[str, int] | None = None) -> dict[str, float]:
        """The batch-size-weighted means of what was recorded after `since` and up to `until`
        (positions; None: up to now), e.g. one client's local training."""
        out = {}
        for key, (values, sizes) in self._records.items():
            start = since.get(key, 0)
            end = len(values) if until is None else until.get(key, 0)
            if end > start:
                total, weight = _weighted_sum(values[start:end], sizes[start:end])
                out[key] = total / weight
        return out

    @staticmethod
    def merge(parts: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
        """The round's means over the flushed parts of every process (in rank order)."""
        merged: dict[str, tuple[float, float]] = {}
        for part in parts:
            for key, (s, w) in part.items():
                s0, w0 = merged.get(key, (0.0, 0.0))
                merged[key] = (s0 + s, w0 + w)
        return {key: s / w for key, (s, w) in merged.items()}
