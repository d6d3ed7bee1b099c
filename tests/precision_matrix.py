"""Two tiny rounds of a method of every family in a given Trainer precision (tests/test_precision_matrix.py;
`python tests/precision_matrix.py [precision ...]` prints the table)."""

from __future__ import annotations

import collections
import math
import traceback

import lightning as L
import torch
from method_digests import build
from torch.overrides import TorchFunctionMode

from fl_lightning.federation import FederatedCallback

# one method per kind of local step (and `+ CONST`, the constraint after every step)
FAMILIES = ("FedAvg", "FedProx", "SCAFFOLD", "FedSAM", "FedSOL", "MOON", "FedDrPlus", "Ditto", "FedORGP", "FedGen",
            "FedAvg+CONST")
PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true")
DTYPE = {"32-true": torch.float32, "64-true": torch.float64, "bf16-mixed": torch.float32,
         "bf16-true": torch.bfloat16}


class HostSyncs(TorchFunctionMode):
    """Counts, by the package's line that asked, every tensor value taken to the host (`bool`,
    `float`, `int`, `.item()`, `.tolist()`): on a GPU each waits for the device to finish."""

    TO_HOST = {torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
               torch.Tensor.item, torch.Tensor.tolist}

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.TO_HOST:
            ours = [f for f in traceback.extract_stack() if "/fl_lightning/" in f.filename]
            self.sites[f"{ours[-1].filename.rpartition('/fl_lightning/')[2]}:{ours[-1].lineno}" if ours else "?"] += 1
        return func(*args, **(kwargs or {}))


def count_host_syncs(method) -> HostSyncs:
    """Wraps `method.minibatch_step` (a whole local step: the loss, its backward, corrections,
    the optimizer step, constraints) in a HostSyncs mode."""
    syncs, step = HostSyncs(), method.minibatch_step

    def counted(batch):
        with syncs:
            return step(batch)

    method.minibatch_step = counted
    return syncs


def two_rounds(family: str, precision: str, analyses: bool = False) -> dict:
    torch.manual_seed(0)
    name, _, extra = family.partition("+")
    method, dm = build(name, client_test_fraction=0.25 if analyses else None)
    if extra == "CONST":
        method.constraint = "joint"
    # the local models evaluated after every client, as the CLI does by default (float32 test
    # batches reached a float64 or bfloat16 model there)
    callbacks = [FederatedCallback(eval_local_models=True, local_eval_samples=64)]
    if analyses:
        from fl_lightning.analysis.callback import AnalysisCallback
        from fl_lightning.personalization import PersonalizationCallback

        callbacks.append(AnalysisCallback(every_n_rounds=1, samples=64, top_k=2, max_hvps=6, layer_hvps=2,
                                          surface_points=3))
        # personalised evaluation: fine-tuning copies, the method's own personal models
        callbacks.append(PersonalizationCallback(enabled=True, epochs=[1], objective="method", max_clients=2,
                                                 local_only=True, local_only_epochs=1))
    trainer = L.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, precision=precision, callbacks=callbacks,
                        default_root_dir="/tmp/precision_matrix")
    syncs = count_host_syncs(method)
    trainer.fit(method, dm)
    acc = trainer.callback_metrics.get(method.accuracy_key)
    floats = [v for v in method.state_dict().values() if v.is_floating_point()]
    return {"acc": None if acc is None else float(acc),
            "finite": all(bool(torch.isfinite(v.float()).all()) for v in floats),
            "dtypes": {str(v.dtype) for v in method.parameters() if v.is_floating_point()},
            "host_syncs": dict(syncs.sites)}


if __name__ == "__main__":
    import sys
    import time
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for precision in sys.argv[1:] or PRECISIONS:
        for family in FAMILIES:
            start = time.perf_counter()
            try:
                r = two_rounds(family, precision)
                ok = r["finite"] and r["acc"] is not None and math.isfinite(r["acc"])
                print(f"{precision:10s} {family:14s} {'ran' if ok else 'BAD'} acc={r['acc']} {r['dtypes']} "
                      f"{time.perf_counter() - start:.1f}s", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{precision:10s} {family:14s} ERROR {type(err).__name__}: {str(err)[:150]}", flush=True)
