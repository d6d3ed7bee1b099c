"""Test-only methods that fail the way runs fail, for CLI subprocesses (`--model faulty_methods.X`
with PYTHONPATH=tests): one client whose training diverges, a global model that collapses."""

import torch

from fl_lightning.methods import FedAvg


class PoisonedClient(FedAvg):
    """FedAvg where one client's upload is NaN (its local training diverged); the others are fine.

    Args:
        poisoned: the client whose upload is NaN.
    """

    def __init__(self, poisoned: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def client_end(self):
        upload = super().client_end()
        if upload.client == self.hparams.poisoned:
            upload.weights["head.bias"] = torch.full_like(upload.weights["head.bias"], float("nan"))
        return upload


class Collapsing(FedAvg):
    """FedAvg whose global model is zeroed from round `from_round` (1-based) on: finite weights, one
    constant prediction (the papers' "Failed").

    Args:
        from_round: the first round whose server step gives a zero model.
    """

    def __init__(self, from_round: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def server_step(self, uploads):
        update = super().server_step(uploads)
        if self.round_idx + 1 >= self.hparams.from_round:
            update.global_state = {k: torch.zeros_like(v) for k, v in update.global_state.items()}
        return update
