"""SphereFed (Dong et al., ECCV 2022): hyperspherical federated learning.

Training: a fixed classifier W with orthonormal rows, logits = cosines W normalise(f(x)), loss =
squared error to the one-hot label (sum over classes, batch mean; `mse_reduction: mean` averages
over classes too). After training, the classifier is recalibrated in closed form: each client sends
only the statistics G_k = sum h h^T (d x d) and B_k = sum h y^T (d x C) of its normalised features h
under the final global model, and the server solves the least-squares (ridge) problem

    W^T = (sum_k G_k + lambda I)^-1 sum_k B_k,

i.e. the centralised least-squares classifier on all clients' features, without their data.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info

from fl_lightning.evaluation import as_model_input, model_dtype
from fl_lightning.methods.base import LossContext
from fl_lightning.methods.frozen.base import FrozenClassifierMethod
from fl_lightning.models import FLModel


@torch.no_grad()
def feature_label_statistics(model: FLModel, loader, num_classes: int,
                             device) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's upload for recalibration: (H^T H, H^T Y) of its normalised features, float64."""
    was_training = model.training
    model.eval()
    d = model.feature_dim
    gram = torch.zeros(d, d, dtype=torch.float64, device=device)
    cross = torch.zeros(d, num_classes, dtype=torch.float64, device=device)
    dtype = model_dtype(model)
    for x, y in loader:
        h = F.normalize(model.features(as_model_input(x, device, dtype)).double(), dim=1)
        gram += h.T @ h
        cross += h.T @ F.one_hot(y.to(device), num_classes).double()
    model.train(was_training)
    return gram, cross


def least_squares_classifier(grams, crosses, ridge: float) -> torch.Tensor:
    """W (C x d) minimising sum_k ||H_k W^T - Y_k||^2 + ridge ||W||^2 from summed statistics."""
    gram, cross = sum(grams), sum(crosses)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + ridge * eye, cross).T


class SphereFed(FrozenClassifierMethod):
    """SphereFed (Dong et al., ECCV 2022): a fixed orthonormal classifier, MSE loss on the
    hypersphere, and a closed-form classifier recalibration at the end.

    Args:
        recalibrate: replace the classifier by the closed-form least-squares solution at the end of
            training (SphereFed's calibration step).
        recalibration_ridge: lambda of that solve (keeps it well-posed when d > samples).
        mse_reduction: "sum" over classes (batch mean) or "mean" over all entries.
    """

    def __init__(self, recalibrate: bool = True, recalibration_ridge: float = 1e-3,
                 mse_reduction: Literal["sum", "mean"] = "sum", **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()

    fixed_head = ("orthonormal", True)

    def loss(self, model: FLModel, batch, context: LossContext) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        sq = (logits - F.one_hot(y, logits.shape[1]).to(logits.dtype)) ** 2
        return sq.sum(1).mean() if self.hparams.mse_reduction == "sum" else sq.mean()

    def recalibrate(self, datamodule) -> None:
        """Server-side closed-form classifier from every client's feature statistics."""
        grams, crosses = [], []
        for client in range(datamodule.num_clients):
            loader = datamodule.client_loader(client, "train", augment=False)
            g, c = feature_label_statistics(self.model, loader, self.model.head.weight.shape[0], self.device)
            grams.append(g)
            crosses.append(c)
        w = least_squares_classifier(grams, crosses, self.hparams.recalibration_ridge)
        with torch.no_grad():
            self.model.head.weight.copy_(w.to(self.model.head.weight.dtype))
        rank_zero_info(f"SphereFed: classifier recalibrated from {len(grams)} clients' feature statistics")

    def on_train_end(self) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if not self.hparams.recalibrate or dm is None:
            return
        self.recalibrate(dm)
        # The per-round validation saw the fixed classifier; report the recalibrated model too.
        # (The last per-round checkpoint was written before this step.)
        result = self.evaluate(dm.test_dataloader())
        acc, loss = result.accuracy, result.loss
        rank_zero_info(f"SphereFed: recalibrated global test acc {acc:.4f}, loss {loss:.4f}")
        if self.trainer.global_rank == 0:
            for logger in self.trainer.loggers:
                logger.log_metrics({"global/test_acc_recalibrated": acc}, step=self.trainer.global_step)
