"""Cost of the --analysis.* Hessian spectrum and loss surface against the training it observes.

Setting: the FedAvg CNN (`fedavg_cnn`, 1.66 M parameters) on 1,000 MNIST-5k training digits (the
default --analysis.samples), at a model trained for a few rounds of the demo (FedSOL in
configs/settings/mnist5k.yaml) or at `--ckpt` (a round checkpoint of such a run).

Measures, in this one process:
- top-5 eigenvalues by Lanczos (budget 40 products, relative residual 1e-3): seconds, products
  used, and the residual bound of each of the five;
- an 11 x 11 loss/accuracy surface along the top-2 eigenvectors: seconds;
- with --full, the default --analysis set (top-5, 10 Hutchinson probes, layer-wise lambda_1,
  11 x 11 surface);
- the every-round divergence statistics (distances and cosines of 10 client models, the global
  model's class-wise accuracy on 300 test digits), which are on by default;
- the wall time of a 5-round interval of the demo run (the same fit, timed per round),
and prints each analysis as a fraction of that interval (target: < 10%; top-5 in <= 40 products).

    python -u benchmarks/analysis_cost.py [--rounds 5] [--full] [--ckpt runs/mnist5k/fedsol/checkpoints/last.ckpt]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import numpy as np
import torch

from fl_lightning.analysis.hessian import hessian_spectrum
from fl_lightning.analysis.objective import SubsetObjective
from fl_lightning.analysis.surface import surface_2d
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedSOL

DEMO_DATA = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
                 partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)
DEMO_METHOD = dict(model="fedavg_cnn", rho=2.0, adaptive="layer", perturb="head", temperature=3.0, lr=0.01,
                   momentum=0.9, weight_decay=1e-5, lr_decay=0.99)


class RoundTimer(L.Callback):
    def __init__(self):
        self.times, self._start = [], 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):  # the round including its validation
        self.times.append(time.perf_counter() - self._start)


def demo_rounds(rounds: int):
    """The demo's FedSOL run for `rounds` rounds (local models on 300 test digits, as its config)."""
    L.seed_everything(0, verbose=False)
    dm = FederatedDataModule(**DEMO_DATA)
    dm.setup()
    method = FedSOL(data_spec=dm.spec, **DEMO_METHOD)
    timer = RoundTimer()
    trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, use_distributed_sampler=False,
                        callbacks=[FederatedCallback(local_eval_samples=300), timer])
    trainer.fit(method, dm)
    return method, dm, timer.times


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5, help="demo rounds to train and time (>= 2)")
    parser.add_argument("--ckpt", default=None, help="analyse this checkpoint's model instead")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--full", action="store_true", help="also time the default --analysis set "
                        "(+ 10 trace probes, layer-wise lambda_1: about 3x the top-5's products)")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))

    method, dm, round_times = demo_rounds(args.rounds)
    if args.ckpt:
        state = torch.load(args.ckpt, map_location="cpu", weights_only=False)["state_dict"]
        method.load_state_dict(state)
    model = method.model
    per_round = statistics.median(round_times[1:] if len(round_times) > 1 else round_times)
    interval = 5 * per_round
    data = dm.plain_train_set
    idx = np.sort(np.random.default_rng(0).choice(len(data), args.samples, replace=False))
    x = torch.stack([data[int(i)][0] for i in idx])
    y = torch.as_tensor([int(data[int(i)][1]) for i in idx])
    objective = SubsetObjective(model, x, y)

    spectrum, top5_s = timed(lambda: hessian_spectrum(objective, k=5, max_iter=40, tol=1e-3, layerwise=False))
    d1, d2 = spectrum.top_vectors[:2]
    _, surface_s = timed(lambda: surface_2d(objective, d1, d2, radius=1.0, points=11))
    full_s = full_hvps = None
    if args.full:
        objective.num_hvps = 0
        full, full_s = timed(lambda: hessian_spectrum(objective, k=5, max_iter=40, tol=1e-3, trace_probes=10,
                                                      layerwise=True, layer_iter=15))
        _, full_surface_s = timed(lambda: surface_2d(objective, *full.top_vectors[:2], radius=1.0, points=11))
        full_s, full_hvps = full_s + full_surface_s, full.num_hvps

    divergence_s = every_round_cost(model, dm)
    hvp_s = top5_s / max(spectrum.lanczos_hvps, 1)
    print(f"model fedavg_cnn, {objective.dim} parameters, {len(y)} MNIST-5k training digits, "
          f"threads {torch.get_num_threads()}, hvp mode {objective.hvp_mode}")
    print(f"demo round (FedSOL, median of rounds 2..{len(round_times)}): {per_round:.2f} s; "
          f"5-round interval {interval:.1f} s")
    print(f"top-5 eigenvalues: {top5_s:.2f} s, {spectrum.lanczos_hvps} Hessian-vector products "
          f"({hvp_s:.3f} s each), target <= 40: {'met' if spectrum.lanczos_hvps <= 40 else 'MISSED'}")
    print("  lambda_1..5 = " + ", ".join(f"{v:.4g}" for v in spectrum.top)
          + f"; lambda_1/lambda_5 = {spectrum.top[0] / spectrum.top[4]:.3f}"
          + f"; lambda_min (Ritz) = {spectrum.minimum:.4g}")
    print("  relative residual bounds = " + ", ".join(
        f"{r / abs(v):.1e}" for r, v in zip(spectrum.top_residuals, spectrum.top, strict=True)))
    print(f"11 x 11 surface (121 loss evaluations): {surface_s:.2f} s")
    if full_s is not None:
        print(f"default --analysis set (top-5 + 10 trace probes + layer-wise lambda_1 + 11 x 11 surface): "
              f"{full_s:.2f} s, {full_hvps} products")
    print(f"every-round divergence statistics: {divergence_s:.3f} s "
          f"({divergence_s / per_round:.3f} of a demo round)")
    for name, seconds in (("top-5", top5_s), ("surface", surface_s), ("default set", full_s)):
        if seconds is None:
            continue
        ratio = seconds / interval
        print(f"ratio {name} / 5-round interval: {ratio:.3f} ({'under' if ratio < 0.1 else 'OVER'} the 10% target)")


def every_round_cost(model, dm) -> float:
    """What AnalysisCallback adds to every round: distances/cosines of 10 uploads to the round-start
    model, and the global model's class-wise accuracy on the 300-digit local-evaluation subset."""
    from fl_lightning.analysis.callback import _scores, _stack
    from fl_lightning.analysis.divergence import classwise_accuracy, client_updates, divergence_stats

    g = torch.Generator().manual_seed(0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    uploads = [{n: p + 1e-3 * torch.randn(p.shape, generator=g) for n, p in start.items()} for _ in range(10)]
    subset = dm.global_test_subset_loader(300).dataset
    x, y = _stack(subset, np.arange(len(subset)))
    begin = time.perf_counter()
    divergence_stats(client_updates(uploads, start))
    classwise_accuracy(_scores(model, None, x, 500), y, 10)
    return time.perf_counter() - begin


if __name__ == "__main__":
    main()
