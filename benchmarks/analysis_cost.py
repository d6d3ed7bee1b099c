"""Cost of the --analysis.* Hessian spectrum and loss surface against the training it observes.

Setting: the FedAvg CNN (`fedavg_cnn`, 1.66 M parameters) on a fixed subset of MNIST-5k training
digits, analysed with the AnalysisCallback's defaults (subset size, Lanczos budget and tolerance,
grid, Hessian-vector product mode) unless overridden, against the demo run
(configs/settings/mnist5k.yaml + configs/methods/fedsol/fedsol.yaml: FedSOL, 10 clients of 50 per
round, 5 local epochs).

The machine is shared, so training and analysis are measured interleaved in one process: the demo
trains for `--rounds` rounds; round 1 is a warm-up, and after each later round (its time taken,
including its validation) one analysis of the current global model is timed, alternately the
top-5 eigenvalues and the 2-D surface. The 5-round interval is 5 x the median round time; each
analysis's cost is the median of its repetitions (>= 3 with the default 7 rounds).

Prints: seconds and Hessian-vector products for the top-5 eigenvalues (target: <= 40 products),
seconds for the surface (default grid, and 11 x 11 if different), each as a fraction of the
5-round interval (target: < 10%), the every-round divergence statistics, and `uptime`'s load.

    python -u benchmarks/analysis_cost.py [--rounds 7] [--samples N] [--points P] [--hvp graph|forward|double]
                                          [--full] [--ckpt runs/mnist5k/fedsol/checkpoints/last.ckpt]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import lightning as L
import numpy as np
import torch

from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.analysis.hessian import hessian_spectrum
from fl_lightning.analysis.objective import SubsetObjective
from fl_lightning.analysis.surface import filter_normalized_direction, surface_2d
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.federation import FederatedCallback
from fl_lightning.methods import FedSOL

DEMO_DATA = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
                 partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)
DEMO_METHOD = dict(model="fedavg_cnn", rho=2.0, adaptive="layer", perturb="head", temperature=3.0, lr=0.01,
                   momentum=0.9, weight_decay=1e-5, lr_decay=0.99)
DEFAULTS = {name: p.default for name, p in inspect.signature(AnalysisCallback.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def load() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


class InterleavedCost(L.Callback):
    """Times each round, then (outside the round's time) one analysis of the global model."""

    def __init__(self, analyses, model_for_analysis=None):
        self.analyses = analyses  # [(name, fn(model) -> dict)], taken in turn after rounds 2, 3, ...
        self.model_for_analysis = model_for_analysis
        self.round_times: list[float] = []
        self.results: dict[str, list[dict]] = {name: [] for name, _ in analyses}
        self._start = 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):  # the round including its validation
        if trainer.sanity_checking:
            return
        self.round_times.append(time.perf_counter() - self._start)
        done = len(self.round_times)
        if done == 1:
            return  # warm-up round
        name, fn = self.analyses[(done - 2) % len(self.analyses)]
        start = time.perf_counter()
        info = fn(self.model_for_analysis or pl_module.model)
        info["seconds"] = time.perf_counter() - start
        self.results[name].append(info)
        print(f"  after round {done} ({self.round_times[-1]:.1f} s): {name} {info['seconds']:.1f} s "
              + ", ".join(f"{k} {v}" for k, v in info.items() if k != "seconds") + f" [{load()}]", flush=True)


def _top5(objective, max_hvps: int, tol: float) -> dict:
    s = hessian_spectrum(objective, k=5, max_iter=max_hvps, tol=tol, layerwise=False)
    return {"hvps": s.lanczos_hvps, "lambda_1": round(s.top[0], 4),
            "lambda_1/lambda_5": round(s.top[0] / s.top[4], 3),
            "max_rel_residual": f"{max(r / abs(v) for r, v in zip(s.top_residuals, s.top, strict=True)):.1e}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7, help="demo rounds (round 1 is a warm-up; >= 4)")
    parser.add_argument("--ckpt", default=None, help="analyse this checkpoint's model instead of the live one")
    parser.add_argument("--samples", type=int, default=DEFAULTS["samples"])
    parser.add_argument("--points", type=int, default=DEFAULTS["surface_points"], help="surface grid per axis")
    parser.add_argument("--hvp", default=DEFAULTS["hvp"], choices=["graph", "forward", "double"])
    parser.add_argument("--also-11x11", action="store_true", help="also time an 11 x 11 surface")
    parser.add_argument("--full", action="store_true", help="also time the default --analysis set "
                        "(top-k, trace probes, layer-wise lambda_1, surface)")
    args = parser.parse_args()
    max_hvps, tol, chunk = DEFAULTS["max_hvps"], DEFAULTS["tol"], DEFAULTS["chunk_size"]

    L.seed_everything(0, verbose=False)
    dm = FederatedDataModule(**DEMO_DATA)
    dm.setup()
    data = dm.plain_train_set
    idx = np.sort(np.random.default_rng(0).choice(len(data), args.samples, replace=False))
    x = torch.stack([data[int(i)][0] for i in idx])
    y = torch.as_tensor([int(data[int(i)][1]) for i in idx])
    method = FedSOL(data_spec=dm.spec, **DEMO_METHOD)
    fixed = None
    if args.ckpt:
        fixed = FedSOL(data_spec=dm.spec, **DEMO_METHOD)
        fixed.load_state_dict(torch.load(args.ckpt, map_location="cpu", weights_only=True)["state_dict"])
        fixed = fixed.model

    def objective(model):
        return SubsetObjective(model, x, y, chunk_size=chunk, hvp_mode=args.hvp)

    def top5(model):
        return _top5(objective(model), max_hvps, tol)

    def surface(points):
        def run(model):  # the grid's cost does not depend on its directions: random ones here
            obj = objective(model)
            g = torch.Generator().manual_seed(0)
            d1, d2 = filter_normalized_direction(obj.params, g), filter_normalized_direction(obj.params, g)
            surface_2d(obj, d1, d2, radius=DEFAULTS["surface_radius"], points=points)
            return {}
        return run

    def full(model):
        obj = objective(model)
        s = hessian_spectrum(obj, k=DEFAULTS["top_k"], max_iter=max_hvps, tol=tol,
                             trace_probes=DEFAULTS["trace_probes"], layerwise=DEFAULTS["layerwise"],
                             layer_iter=DEFAULTS["layer_hvps"])
        obj.release_graph()
        surface_2d(obj, *s.top_vectors[:2], radius=DEFAULTS["surface_radius"], points=args.points)
        return {"hvps": s.num_hvps}

    analyses = [("top-5", top5), (f"surface {args.points}x{args.points}", surface(args.points))]
    if args.also_11x11 and args.points != 11:
        analyses.append(("surface 11x11", surface(11)))
    if args.full:
        analyses.append(("default set", full))
    timer = InterleavedCost(analyses, fixed)
    print(f"fedavg_cnn on {len(y)} MNIST-5k training digits, hvp {args.hvp}, chunk {chunk}, Lanczos budget "
          f"{max_hvps} tol {tol}, threads {torch.get_num_threads()}; start: {load()}", flush=True)
    trainer = L.Trainer(max_epochs=args.rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, use_distributed_sampler=False,
                        callbacks=[FederatedCallback(local_eval_samples=300), timer])
    trainer.fit(method, dm)

    rounds = timer.round_times[1:]
    per_round = statistics.median(rounds)
    interval = 5 * per_round
    print(f"\nend: {load()}")
    print(f"demo round (FedSOL), median of rounds 2..{len(timer.round_times)}: {per_round:.2f} s "
          f"(each: {', '.join(f'{t:.1f}' for t in rounds)}); 5-round interval {interval:.1f} s")
    for name, results in timer.results.items():
        if results:
            _print_cost(name, results, interval)
    divergence_s = every_round_cost(method.model, dm)
    print(f"every-round divergence statistics: {divergence_s:.3f} s ({divergence_s / per_round:.3f} of a demo round)")


def every_round_cost(model, dm) -> float:
    """What AnalysisCallback adds to every round: distances/cosines of 10 uploads to the round-start
    model, and the global model's class-wise accuracy on the 300-digit local-evaluation subset."""
    from fl_lightning.analysis.callback import _scores, _stack
    from fl_lightning.analysis.divergence import classwise_accuracy, client_updates, divergence_stats

    g = torch.Generator().manual_seed(0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    uploads = [{n: p + 1e-3 * torch.randn(p.shape, generator=g) for n, p in start.items()} for _ in range(10)]
    subset = dm.global_test_subset_loader(300).dataset
    if hasattr(subset, "batches"):
        x, y = (torch.cat(parts) for parts in zip(*subset.batches, strict=True))
    else:
        x, y = _stack(subset, np.arange(len(subset)))
    begin = time.perf_counter()
    divergence_stats(client_updates(uploads, start))
    classwise_accuracy(_scores(model, None, x, 500), y, 10)
    return time.perf_counter() - begin


def _print_cost(name: str, results: list[dict], interval: float) -> None:
    key = "seconds"
    seconds = statistics.median(r[key] for r in results)
    line = f"{name}: median {seconds:.2f} s over {len(results)} ({', '.join(f'{r[key]:.1f}' for r in results)})"
    if "hvps" in results[0]:
        hvps = [r["hvps"] for r in results]
        line += f", {statistics.median(hvps):g} Hessian-vector products ({', '.join(map(str, hvps))})"
        if name == "top-5":
            line += f", {seconds / statistics.median(hvps):.2f} s each; <= 40: " + \
                    ("met" if max(hvps) <= 40 else "MISSED")
    ratio = seconds / interval
    print(line + f"; ratio to the 5-round interval {ratio:.3f} ({'under' if ratio < 0.1 else 'OVER'} 10%)")


if __name__ == "__main__":
    main()
