"""`--analysis.*`: what training does to the model, as W&B panels and as files.

- At fit start: the partition as a clients x classes heatmap and a table of class counts (once per
  run: a resumed fit does not log it again).
- Every round (cheap, on by default): distances of the round's local models to the global model
  (mean/std/min/max of ||w_k - w_g||), the mean pairwise distance and cosine between client
  updates, the global model's accuracy per class, each local model's accuracy on the same test
  subset as a histogram; every `heatmap_every_n_rounds` rounds a clients x classes heatmap of the
  local models' class-wise accuracy.
- Every `every_n_rounds` rounds and at the last round (off by default): the Hessian spectrum of
  the training loss on a fixed, seeded subset (top-k and minimum eigenvalues by Lanczos,
  Hutchinson trace, lambda_1 per layer) and a 2-D loss surface (top-2 Hessian eigenvectors or
  filter-normalised random directions), optionally 1-D slices.

Scalars go to the module's log under `analysis/...` (so to W&B and metrics.csv), pictures and
the surface table to W&B, and everything to `<run dir>/analysis/round_XXX/` (JSON + PNG).

None of it can change training: the analyses are pure functions of detached weight copies
(`objective.py`), run in eval mode with their flags restored, draw randomness only from their own
seeded generators, and read data by indexing datasets (a DataLoader would draw its base seed
from the global RNG).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.func import functional_call

from fl_lightning import compat
from fl_lightning.analysis import plots
from fl_lightning.analysis.divergence import classwise_accuracy, divergence_stats, partition_counts, update_gram
from fl_lightning.analysis.hessian import hessian_spectrum
from fl_lightning.analysis.objective import HVP_MODES, SubsetObjective, eval_mode
from fl_lightning.analysis.surface import DIRECTION_KINDS, filter_normalized_direction, slice_1d, surface_2d
from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.errors import FLUserError
from fl_lightning.federation import LOCAL_CLASS_ACC, federation_before, federation_of
from fl_lightning.loggers import FLWandbLogger
from fl_lightning.outcome import uninterrupted
from fl_lightning.progress import StageBars, close_bars
from fl_lightning.round_metrics import log_round_metrics

SURFACE_KINDS = (*DIRECTION_KINDS, "none")
HVP_CHOICES = tuple(m for m in HVP_MODES if m != "auto")  # --analysis.hvp; "auto" is for direct use


def _draw_partition(counts: np.ndarray, title: str, path: Path) -> np.ndarray:
    # the same picture in a sweep's runs of one method and partition (its seeds): drawn once
    image = plots.shared_image(plots.heatmap_image, counts, title, "class", "client id",
                               quantity="training samples", row_labels=range(len(counts)))
    plots.save_png(image, path)
    return image


def _wandb_media(kind: str, value: Any):
    """A W&B image, histogram or table of `value` (a future's value when it is one)."""
    import wandb

    if isinstance(value, Future):
        value = value.result()
    if kind == "image":
        return wandb.Image(value)
    if kind == "histogram":
        return wandb.Histogram(value)
    if kind == "surface_table":
        return wandb.Table(columns=["round", "alpha", "beta", "loss", "acc"], data=value)
    columns, rows = value
    return wandb.Table(columns=columns, data=rows)


def global_model(pl_module) -> torch.nn.Module | None:
    """The method's global model, if it has one (the analysis model without a prefix)."""
    return dict(pl_module.analysis_models(0)).get("")


class AnalysisCallback(L.Callback):
    """Loss landscapes, Hessian spectrum, client divergence and the partition.

    Args:
        every_n_rounds: Hessian spectrum and loss surface every n rounds and at the last round
            (0 = never during fit; `fl-lightning analyze` runs them on a checkpoint).
        samples: size of the fixed subset of (unaugmented) training data the loss is taken on.
        seed: draws that subset, the Lanczos start vector, the trace probes and random directions.
        top_k: Hessian eigenvalues to report (lambda_1 .. lambda_k; lambda_1/lambda_k).
        max_hvps: Lanczos budget (Hessian-vector products); it stops earlier once the top k have
            converged to `tol` (relative residual).
        tol: relative residual at which a Ritz value counts as converged.
        trace_probes: Rademacher probes of the Hutchinson trace (0 = no trace).
        layerwise: also lambda_1 of each layer's Hessian block (`layer_hvps` products per layer).
        layer_hvps: Lanczos budget per layer.
        surface: directions of the 2-D surface: "hessian" (top-2 eigenvectors, FedSOL Fig. 8),
            "random" (filter-normalised, Li et al. 2018) or "none".
        surface_points: grid points per axis (odd: the centre is the model itself).
        surface_radius: the grid spans [-r, r] along each direction (unit eigenvectors, or
            filter-normalised directions whose filters have the weights' norms).
        slices: also 1-D slices of the loss along each of the two directions.
        divergence: the every-round divergence and class-wise statistics.
        test_samples: size of the fixed global test subset for class-wise accuracies (0 = all;
            default: the federation's `local_eval_samples`, the subset local models are tested on).
        heatmap_every_n_rounds: clients x classes heatmap of local models' class-wise accuracy
            every n rounds (0 = never).
        partition: log the partition heatmap and class-count table at fit start.
        max_client_models: model-heterogeneous methods (no global model): analyse the models of
            clients 0 .. n-1.
        chunk_size: samples per forward pass in the analyses (memory bound).
        hvp: how Hessian-vector products are computed (same numbers, different cost): "graph"
            keeps the subset's first-order gradient graph and back-propagates through it per
            product (fastest; memory of the whole subset's double-backward graph), "forward"
            (torch.func forward-over-reverse) and "double" (double backward) recompute it per
            product, one chunk at a time (memory of one chunk).
    """

    def __init__(self, every_n_rounds: int = 0, samples: int = 1000, seed: int = 0, top_k: int = 5,
                 max_hvps: int = 40, tol: float = 1e-3, trace_probes: int = 10, layerwise: bool = True,
                 layer_hvps: int = 15, surface: Literal["hessian", "random", "none"] = "hessian",
                 surface_points: int = 11, surface_radius: float = 1.0, slices: bool = False,
                 divergence: bool = True, test_samples: int | None = None, heatmap_every_n_rounds: int = 5,
                 partition: bool = True, max_client_models: int = 2, chunk_size: int = 500,
                 hvp: Literal["graph", "forward", "double"] = "graph"):
        super().__init__()
        if surface not in SURFACE_KINDS:
            raise FLUserError(f"analysis.surface: unknown direction kind '{surface}'; choose one of: "
                              f"{', '.join(SURFACE_KINDS)}")
        for name, value, low in (("every_n_rounds", every_n_rounds, 0), ("samples", samples, 1),
                                 ("top_k", top_k, 1), ("max_hvps", max_hvps, 1), ("trace_probes", trace_probes, 0),
                                 ("layer_hvps", layer_hvps, 1), ("surface_points", surface_points, 2),
                                 ("test_samples", test_samples or 0, 0),
                                 ("heatmap_every_n_rounds", heatmap_every_n_rounds, 0),
                                 ("max_client_models", max_client_models, 1), ("chunk_size", chunk_size, 1)):
            if value < low:
                raise FLUserError(f"analysis.{name} must be >= {low}, got {value}")
        if hvp not in HVP_CHOICES:
            raise FLUserError(f"analysis.hvp: unknown mode '{hvp}'; choose one of: {', '.join(HVP_CHOICES)}")
        if surface == "hessian" and top_k < 2:  # checked here, on every rank, not in rank 0's analysis
            raise FLUserError(f"analysis.surface hessian needs top_k >= 2 (two eigenvectors), got {top_k}; "
                              "raise top_k or choose surface random or none")
        if max_hvps < top_k:
            raise FLUserError(f"analysis.max_hvps ({max_hvps}) must be >= analysis.top_k ({top_k})")
        if not surface_radius > 0 or not tol > 0:
            raise FLUserError(f"--analysis.surface_radius and --analysis.tol must be > 0, got {surface_radius}, {tol}")
        self.every_n_rounds, self.samples, self.seed, self.top_k = every_n_rounds, samples, seed, top_k
        self.max_hvps, self.tol, self.trace_probes = max_hvps, tol, trace_probes
        self.layerwise, self.layer_hvps = layerwise, layer_hvps
        self.surface, self.surface_points, self.surface_radius = surface, surface_points, surface_radius
        self.slices, self.divergence, self.test_samples = slices, divergence, test_samples
        self.heatmap_every_n_rounds, self.partition = heatmap_every_n_rounds, partition
        self.max_client_models, self.chunk_size, self.hvp = max_client_models, chunk_size, hvp
        self.forced = False  # `fl-lightning analyze` sets this: analyse the loaded checkpoint once
        self.checkpoint_round = 0  # and this: the rounds the checkpointed model has been through
        self.written: Path | None = None  # the folder the last analysis was written to
        self._train_subset: tuple[torch.Tensor, torch.Tensor] | None = None
        self._test_subset: tuple[torch.Tensor, torch.Tensor] | None = None
        self._round_start: dict[str, torch.Tensor] | None = None
        self._table_rows: list[list[float]] = []
        self._spectrum_history: dict[str, dict[int, tuple[float, float]]] = {}  # prefix -> round -> (l1, l1/lk)
        self._said: set[str] = set()
        self._partition_drawn: Future | None = None  # the partition picture, drawn in the background
        self._classwise_heatmaps = plots.HeatmapSeries("class", "client id", "accuracy", limits=(0.0, 1.0))

    # ---- hooks --------------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self.check_model(pl_module)
        federation = federation_before(trainer, self)
        if self.divergence and federation is not None:
            federation.share_round_uploads = True  # distances between every pair of the round's clients
        if self.partition and trainer.is_global_zero and hasattr(trainer.datamodule, "client_parts"):
            # A resumed fit continues the W&B run that holds the partition (at step 0) already; its
            # files are written again only if they are missing.
            resumed = trainer.ckpt_path is not None
            if not resumed or not (Path(trainer.default_root_dir) / "analysis" / "partition.json").exists():
                self.log_partition(trainer, to_wandb=not resumed)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        model = global_model(pl_module) if self.divergence and trainer.is_global_zero else None
        if model is not None:
            self._round_start = {n: p.detach().clone() for n, p in model.named_parameters()}
        federation = federation_of(trainer)
        if federation is not None:
            # the heatmap's local class-wise accuracies come from the federation's evaluation of
            # each local model when it evaluates them on the same subset (every process asks)
            federation.local_class_accuracy = bool(
                self.divergence and self._heatmap_due(trainer, trainer.current_epoch + 1)
                and self.test_samples in (None, federation.local_eval_samples))

    def _heatmap_due(self, trainer, round_no: int) -> bool:
        every = self.heatmap_every_n_rounds
        return bool(every and (round_no % every == 0 or round_no == trainer.max_epochs))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.partition_written()  # its failure (a full disk) is the fit's, at its first round at the latest
        # Under DDP every rank holds the same global model: rank 0 alone analyses it and writes the
        # files. Nothing below is a collective (no sync_dist, no barrier), so the other ranks go on
        # to the next round and meet rank 0 at the round's first collective.
        federation = federation_of(trainer)
        if not trainer.is_global_zero or (federation is not None and not federation.round_report.completed):
            return  # (a round that stopped the run before its server step has nothing to analyse)
        round_no = trainer.current_epoch + 1  # rounds completed, 1-based
        scalars: dict[str, float] = {}
        files: dict[str, Any] = {}
        if self.divergence:
            scalars.update(self.round_divergence(trainer, pl_module, round_no, files))
        due = self.every_n_rounds and (round_no % self.every_n_rounds == 0 or round_no == trainer.max_epochs)
        logged: dict[str, float] = {}
        if due:
            started = time.perf_counter()
            scalars.update(self.run_analysis(trainer, pl_module, round_no, files))
            # what the analysis adds to this round, next to the round's own perf/round_seconds
            logged["perf/analysis_seconds"] = time.perf_counter() - started
        logged.update({f"analysis/{k}": float(v) for k, v in scalars.items()})
        if logged:
            log_round_metrics(trainer, logged)  # this process's (rank 0's) own values
        if due or "classwise_local" in files:
            self.write_files(trainer, round_no, scalars, files)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self.forced or trainer.sanity_checking:
            return
        self.check_model(pl_module)  # on every rank: a user error must stop all of them
        if not trainer.is_global_zero:
            return
        close_bars()  # the evaluation's bar is complete: the analysis's own bars and lines go below it
        round_no = self.checkpoint_round
        files: dict[str, Any] = {}
        with torch.inference_mode(False):  # validation runs in inference mode; the analysis needs autograd
            scalars = self.run_analysis(trainer, pl_module, round_no, files)
        for logger in trainer.loggers:
            logger.log_metrics({f"analysis/{k}": float(v) for k, v in scalars.items()} | {"round": round_no})
        self.write_files(trainer, round_no, scalars, files)

    # ---- models to analyse --------------------------------------------------------------------
    def models(self, pl_module) -> list[tuple[str, torch.nn.Module]]:
        """The method's `analysis_models`: ("", the global model), or ("client_k/", client k's model)
        for methods without one."""
        models = pl_module.analysis_models(self.max_client_models)
        if any(prefix for prefix, _ in models):
            self._once(f"{type(pl_module).__name__} has no global model: analysing the models of "
                       f"{', '.join(prefix.rstrip('/') for prefix, _ in models)} (--analysis.max_client_models)")
        return models

    def check_model(self, pl_module) -> None:
        """Fails with one line before any work when the request cannot be met by the model."""
        if not self.every_n_rounds and not self.forced:
            return
        for _, model in self.models(pl_module):
            dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
            if self.top_k > dim:
                raise FLUserError(f"analysis.top_k = {self.top_k} but the model has only {dim} trainable "
                                  f"parameters; choose top_k <= {dim}")
            if self.surface != "none" and dim < 2:
                raise FLUserError("--analysis.surface needs a model with at least 2 parameters; "
                                  "set --analysis.surface none")

    # ---- data ---------------------------------------------------------------------------------
    def train_subset(self, trainer, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._train_subset is None:
            dm = trainer.datamodule
            dataset = dm.plain_train_set
            n = len(dataset)
            idx = np.sort(np.random.default_rng(self.seed).choice(n, min(self.samples, n), replace=False))
            self._train_subset = _stack(dataset, idx)
        return _on_device(trainer, self._train_subset, device)

    def test_subset(self, trainer, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._test_subset is None:
            n = self.test_samples
            if n is None:  # the subset the federation evaluates local models on
                fed = federation_of(trainer)
                n = fed.local_eval_samples if fed is not None else 1000
            loader = trainer.datamodule.global_test_subset_loader(n)
            # Read directly: iterating a DataLoader draws its base seed from the global RNG.
            dataset = loader.dataset
            if hasattr(dataset, "batches"):  # evaluation batches already sliced on the device
                self._test_subset = tuple(torch.cat(parts) for parts in zip(*dataset.batches, strict=True))
            else:
                self._test_subset = _stack(dataset, np.arange(len(dataset)))
        return _on_device(trainer, self._test_subset, device)

    # ---- the every-round statistics -----------------------------------------------------------
    @torch.no_grad()
    def round_divergence(self, trainer, pl_module, round_no: int, files: dict) -> dict[str, float]:
        model = global_model(pl_module)
        if model is None:
            self._once("divergence statistics need a global model; skipped for "
                       f"{type(pl_module).__name__} (model-heterogeneous)")
            return {}
        federation = federation_of(trainer)
        report = federation.round_report if federation is not None else None
        uploads = report.uploads if report is not None else []
        out: dict[str, float] = {}
        gram = update_gram([u.weights for u in uploads], self._round_start or {})
        if gram is not None:
            stats = divergence_stats(gram)
            # the mean is the round's `local/drift_mean` (every client's ||w_k - w_g||), logged always
            stats.pop("client_global_dist_mean")
            out.update(stats)
        num_classes = pl_module.hparams.data_spec.num_classes
        x, y = self.test_subset(trainer, pl_module.device)
        global_acc = classwise_accuracy(_scores(model, None, x, self.chunk_size), y, num_classes)
        out["global_class_acc_min"] = float(np.nanmin(global_acc.numpy()))
        out["global_class_acc_std"] = float(np.nanstd(global_acc.numpy()))
        if num_classes <= 20:
            out.update({f"global_class_acc/{c}": float(a) for c, a in enumerate(global_acc) if not math.isnan(a)})
        accs = [c["local_acc"] for c in report.clients if "local_acc" in c] if report is not None else []
        if accs:  # each local model on the same test subset, as evaluated by the federation
            self._log_media(trainer, round_no, {"analysis/local_acc_hist": ("histogram", accs)})
            files["local_acc"] = accs
        if not self._heatmap_due(trainer, round_no):
            return out
        evaluated = [c for c in report.clients if LOCAL_CLASS_ACC in c] if report is not None else []
        if evaluated:  # the federation's evaluation of each local model, per class, on this subset
            clients = [int(c["client"]) for c in evaluated]
            local = torch.tensor([c[LOCAL_CLASS_ACC] for c in evaluated], dtype=torch.float64)
        else:
            keys = set(model.state_dict())
            full = [u for u in uploads if keys <= set(u.weights)]
            if not full:
                if uploads:
                    self._once("uploads do not carry whole local models: no local class-wise accuracy")
                return out
            # uploads may carry more than the model (SCAFFOLD's control variates): only the model's keys
            clients = [u.client for u in full]
            local = torch.stack([classwise_accuracy(_scores(model, {k: u.weights[k] for k in keys}, x,
                                                            self.chunk_size), y, num_classes) for u in full])
        out["local_class_acc_mean"] = float(np.nanmean(local.numpy()))
        files["classwise_local"] = {"clients": clients, "acc": local.tolist(), "global": global_acc.tolist()}
        # No numbers in the cells (they are in analysis.json): drawing a hundred of them doubled the
        # cost of a picture drawn every few rounds, in the training loop
        # (one figure for the fit, its unchanging parts drawn once: see plots.HeatmapSeries; the
        # colours span 0 to 1, so that the pictures of two rounds compare)
        image = self._classwise_heatmaps.image(local.numpy(), f"{_what(trainer, round_no)}: local models' "
                                               "class-wise accuracy", row_labels=clients)
        files["classwise_local.png"] = image
        self._log_media(trainer, round_no, {"analysis/classwise_local": ("image", image)})
        return out

    # ---- the expensive analysis ---------------------------------------------------------------
    def run_analysis(self, trainer, pl_module, round_no: int, files: dict) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for prefix, model in self.models(pl_module):
            # `analyze` shows its stages (minutes each on a large model); during a fit the round's
            # bar and its analysis line are the progress
            progress = StageBars(f"analysis{' of ' + prefix.rstrip('/') if prefix else ''}") if self.forced else None
            # a heterogeneous client's model waits on the CPU between its rounds
            device = next(model.parameters()).device
            x, y = self.train_subset(trainer, device)
            objective = SubsetObjective(model, x, y, chunk_size=self.chunk_size, hvp_mode=self.hvp)
            loss, acc = objective.loss_and_accuracy()
            scalars[f"{prefix}train_subset_loss"], scalars[f"{prefix}train_subset_acc"] = loss, acc
            started = time.perf_counter()
            spectrum = hessian_spectrum(objective, self.top_k, self.max_hvps, self.tol, self.trace_probes,
                                        self.layerwise, self.layer_hvps, self.seed, progress)
            objective.release_graph()  # the surface needs forward passes only
            scalars.update({f"{prefix}{k}": v for k, v in spectrum.scalars().items()})
            files[f"{prefix}spectrum"] = info = {**spectrum.scalars(), "top": spectrum.top, "subset_loss": loss,
                                                 "subset_acc": acc, "samples": len(y),
                                                 "spectrum_seconds": time.perf_counter() - started}
            self._spectrum_pictures(trainer, prefix, round_no, spectrum, files)
            if self.surface != "none":
                started = time.perf_counter()
                self._surface(trainer, objective, spectrum, prefix, round_no, files, progress)
                info["surface_seconds"] = time.perf_counter() - started
        rank_zero_info("analysis, round " + str(round_no) + ": " + ", ".join(
            f"{k} {v:.4g}" for k, v in scalars.items() if "layer" not in k and "/" not in k[len("client_0/"):]))
        return scalars

    def _spectrum_pictures(self, trainer, prefix: str, round_no: int, spectrum, files: dict) -> None:
        """This round's top-k and layer-wise lambda_1 as bars; over the run, lambda_1 and
        lambda_1/lambda_k against rounds (analysis/<prefix>spectrum_history.png, rewritten)."""
        scalars = spectrum.scalars()
        layers = {k.removeprefix("layer_lambda_1/"): v for k, v in scalars.items() if k.startswith("layer_lambda_1/")}
        name, what = prefix.replace("/", "_"), _what(trainer, round_no)
        bars = plots.spectrum_image(list(spectrum.top), layers, f"{what}: {prefix}Hessian spectrum")
        files[f"{name}spectrum.png"] = bars
        k = len(spectrum.top)
        media = {f"analysis/{prefix}spectrum": ("image", bars)}
        if not self.forced:  # `analyze` sees one checkpoint: no history to draw
            history = self._spectrum_history.setdefault(prefix, {})
            history[round_no] = (float(spectrum.top[0]), float(spectrum.top[0] / spectrum.top[-1]) if k > 1 else 1.0)
            rounds = sorted(history)
            trend = plots.spectrum_history_image(rounds, [history[r][0] for r in rounds],
                                                 [history[r][1] for r in rounds], k,
                                                 f"{_what(trainer, None)}: {prefix}sharpness over rounds")
            if trainer.is_global_zero:
                plots.save_png(trend, Path(trainer.default_root_dir) / "analysis" / f"{name}spectrum_history.png")
            media[f"analysis/{prefix}spectrum_history"] = ("image", trend)
        self._log_media(trainer, round_no, media)

    def _surface(self, trainer, objective, spectrum, prefix: str, round_no: int, files: dict, progress) -> None:
        if self.surface == "hessian":
            if len(spectrum.top_vectors) < 2:
                raise FLUserError("analysis.surface hessian needs top_k >= 2 (two eigenvectors)")
            d1, d2 = spectrum.top_vectors[:2]
            labels = ("top-1 Hessian eigenvector", "top-2 Hessian eigenvector")
        else:
            generator = torch.Generator().manual_seed(self.seed + 1)
            d1 = filter_normalized_direction(objective.params, generator)
            d2 = filter_normalized_direction(objective.params, generator)
            labels = ("random direction 1 (filter-normalised)", "random direction 2 (filter-normalised)")
        points = self.surface_points
        with (progress.stage(f"loss surface, {self.surface} directions", points**2, "pt") if progress is not None
              else contextlib.nullcontext(None)) as advance:
            surf = surface_2d(objective, d1, d2, self.surface_radius, points, self.surface, advance)
        files[f"{prefix}surface"] = {"kind": surf.kind, "alphas": surf.alphas, "betas": surf.betas,
                                     "loss": surf.loss, "acc": surf.acc}
        name = prefix.replace("/", "_")
        what = _what(trainer, round_no)
        loss_img = plots.contour_image(surf.alphas, surf.betas, surf.loss, f"{what}: {prefix}loss surface", *labels,
                                       quantity="training-subset loss")
        acc_img = plots.contour_image(surf.alphas, surf.betas, surf.acc, f"{what}: {prefix}accuracy surface", *labels,
                                      quantity="training-subset accuracy", clip=False, best="max")
        files[f"{name}surface_loss.png"], files[f"{name}surface_acc.png"] = loss_img, acc_img
        self._table_rows += [[round_no, *row] for row in surf.rows()]
        media = {f"analysis/{prefix}surface_loss": ("image", loss_img),
                 f"analysis/{prefix}surface_acc": ("image", acc_img),
                 f"analysis/{prefix}surface_table": ("table", self._table_rows)}
        if self.slices:
            curves = {}
            for label, axis, d in zip(("direction 1", "direction 2"), labels, (d1, d2), strict=True):
                alphas, loss, acc = slice_1d(objective, d, self.surface_radius, self.surface_points)
                curves[axis] = loss
                files.setdefault(f"{prefix}slices", {})[label] = {"alphas": alphas, "loss": loss, "acc": acc}
            img = plots.curve_image(alphas, curves, f"{_what(trainer, round_no)}: {prefix}loss along each direction",
                                    "step along the direction", "training-subset loss")
            files[f"{name}slices.png"] = img
            media[f"analysis/{prefix}slices"] = ("image", img)
        self._log_media(trainer, round_no, media)

    # ---- the partition ------------------------------------------------------------------------
    def log_partition(self, trainer, to_wandb: bool = True) -> None:
        dm = trainer.datamodule
        counts = partition_counts(dm.train_set.labels, dm.client_parts, dm.spec.num_classes)
        out = Path(trainer.default_root_dir) / "analysis"
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / "partition.json", json.dumps({"counts": counts.tolist()}).encode())
        title = f"{_what(trainer, None)}: training samples per client and class"
        # The picture (and W&B's image and table of it) is made in a thread of its own while the
        # first round starts, so that the round does not wait for it: making it is a large part of
        # a fit's start (matplotlib's first text loads its fonts; W&B's first table imports
        # pandas). It uses matplotlib's object-oriented Agg API only (pyplot's
        # global state is not thread-safe). One worker runs the jobs in order. The W&B values go
        # into round 0's history row as futures, which the logger waits for before it sends that
        # row, so the row keeps its place before round 1's; the picture's file is waited for at the
        # end of round 1 at the latest, where an error drawing or writing it stops the fit.
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-lightning-partition")
        self._partition_drawn = worker.submit(_draw_partition, counts, title, out / "partition.png")
        rows = [[c, *counts[c].tolist(), int(counts[c].sum())] for c in range(len(counts))]
        columns = ["client", *[f"class_{k}" for k in range(counts.shape[1])], "total"]
        if to_wandb and any(isinstance(lg, FLWandbLogger) for lg in trainer.loggers):
            image = worker.submit(_wandb_media, "image", self._partition_drawn)
            table = worker.submit(_wandb_media, "table", (columns, rows))
            for logger in trainer.loggers:
                if isinstance(logger, FLWandbLogger):
                    logger.add_to_round({"round": 0, "analysis/partition": image, "analysis/partition_counts": table})
        worker.shutdown(wait=False)
        from lightning.pytorch.loggers import WandbLogger

        others = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger) and not isinstance(lg, FLWandbLogger)]
        if to_wandb and others:
            # another W&B logger sends its values at once: it has the picture when it is drawn
            self._log_media(trainer, 0, {"analysis/partition": ("image", self.partition_written()),
                                         "analysis/partition_counts": ("table", (columns, rows))}, plain_only=True)

    def partition_written(self) -> np.ndarray | None:
        """The partition picture once its file is written (waits for it; raises what stopped it)."""
        return None if self._partition_drawn is None else self._partition_drawn.result()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._partition_drawn is not None:
            wait([self._partition_drawn])  # no file left half-drawn when the fit ends early

    # ---- outputs ------------------------------------------------------------------------------
    def write_files(self, trainer, round_no: int, scalars: dict[str, float], files: dict[str, Any]) -> None:
        if not trainer.is_global_zero:
            return
        # `fl-lightning analyze` writes beside the fit's round folder, never over it
        folder = f"posthoc_round_{round_no:03d}" if self.forced else f"round_{round_no:03d}"
        out = self.written = Path(trainer.default_root_dir) / "analysis" / folder
        out.mkdir(parents=True, exist_ok=True)
        numbers = {k: v for k, v in files.items() if not k.endswith(".png")}
        atomic_write_bytes(out / "analysis.json",
                           json.dumps({"round": round_no, "scalars": scalars, **numbers}, indent=1).encode())
        for key, image in files.items():
            if key.endswith(".png"):
                plots.save_png(image, out / key)

    def _log_media(self, trainer, round_no: int, media: dict[str, tuple[str, Any]], plain_only: bool = False) -> None:
        """Images, histograms and tables go straight to the W&B run (rank 0), with the round.
        `plain_only`: to W&B loggers other than fl-lightning's own."""
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if not isinstance(logger, WandbLogger) or (plain_only and isinstance(logger, FLWandbLogger)):
                continue
            payload: dict[str, Any] = {"round": round_no}
            for key, (kind, value) in media.items():
                payload[key] = _wandb_media("surface_table" if key.endswith("surface_table") else kind, value)
            if isinstance(logger, FLWandbLogger):
                logger.add_to_round(payload)  # in the round's one history row
            else:
                with uninterrupted():  # a signal ends the run after W&B's call (outcome.uninterrupted)
                    logger.experiment.log(payload)

    def _once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            rank_zero_info(message)

    @property
    def state_key(self) -> str:
        return compat.callback_state_key(self, surface=self.surface, every_n_rounds=self.every_n_rounds)

    def state_dict(self) -> dict[str, Any]:
        return {"table_rows": self._table_rows, "spectrum_history": self._spectrum_history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._table_rows = list(state_dict.get("table_rows", []))
        self._spectrum_history = {p: dict(h) for p, h in state_dict.get("spectrum_history", {}).items()}


def _what(trainer, round_no: int | None) -> str:
    """A picture's title prefix: method, setting and round. The setting is the one the run's config
    files name (the W&B group `<setting>/<method>` the CLI gives a fit); without it (no W&B logger,
    a group of the user's own) the dataset and its partition."""
    method = type(trainer.lightning_module).__name__
    setting = None
    for logger in trainer.loggers:
        group = compat.wandb_init_kwargs(logger).get("group") if isinstance(logger, FLWandbLogger) else None
        if isinstance(group, str) and group.count("/") == 1:
            setting = group.split("/")[0]
    if setting is None:
        hparams = getattr(trainer.datamodule, "hparams", {}) or {}
        setting = " ".join(str(hparams[k]) for k in ("dataset", "partition") if hparams.get(k)) or "?"
    return f"{method}, {setting}" + (f", round {round_no}" if round_no is not None else "")


def _on_device(trainer, subset: tuple[torch.Tensor, torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) on the device, x converted as the precision plugin converts training inputs (float64
    under --trainer.precision 64-true, bfloat16 under bf16-true)."""
    x, y = subset
    return trainer.precision_plugin.convert_input(x.to(device)), y.to(device)


def _stack(dataset, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[int(i)] for i in idx]
    return torch.stack([x for x, _ in items]), torch.as_tensor([int(y) for _, y in items], dtype=torch.int64)


@torch.no_grad()
def _scores(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, x: torch.Tensor,
            chunk_size: int) -> torch.Tensor:
    """The model's class scores on x, in eval mode, at its own weights or at `state`."""
    with eval_mode(model):
        chunks = [x[i : i + chunk_size] for i in range(0, len(x), chunk_size)]
        if state is None:
            return torch.cat([model(c) for c in chunks]).float()
        return torch.cat([functional_call(model, state, (c,)) for c in chunks]).float()
