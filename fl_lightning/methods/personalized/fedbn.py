"""FedBN (Li, Jiang, Zhang, Kamp & Dou, ICLR 2021, "FedBN: Federated Learning on Non-IID Features
via Local Batch Normalization"): FedAvg, except that every BatchNorm layer stays with its client,
its affine parameters (weight, bias) and its running statistics alike. The server averages the
rest of the model and never changes the BatchNorm entries of the global model; each client starts
from them, then keeps its own (the base's `personal_keys` mechanism, methods/base.py).

The global model's BatchNorm layers are the initial ones, so its global test accuracy is not the
paper's measure: FedBN evaluates each client's model (the shared layers + its own BatchNorm) on
its own test data, `--personalization.enabled true` (`personal/own_acc_*`).
"""

from __future__ import annotations

from torch import nn

from fl_lightning import compat
from fl_lightning.errors import FLUserError
from fl_lightning.methods.shared_model import SharedModelMethod


class FedBN(SharedModelMethod):
    """FedBN (Li et al., ICLR 2021): BatchNorm layers stay local; the rest is averaged (FedAvg)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not self.personal:
            raise FLUserError(f"FedBN keeps BatchNorm layers local, but model '{self.hparams.model}' has none; "
                              f"choose a model with BatchNorm (e.g. resnet18, mlp_bn)")

    def personal_keys(self, model: nn.Module) -> list[str]:
        return [f"{name}.{key}" if name else key for name, module in model.named_modules()
                if compat.is_batch_norm(module) for key in module.state_dict()]
