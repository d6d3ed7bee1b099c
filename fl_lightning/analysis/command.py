"""`fl-lightning analyze`: the analyses of `--analysis.*` on a saved checkpoint.

LightningCLI builds one subcommand per Trainer method, so `analyze` is a method of a Trainer
subclass. It checks the checkpoint against the configured model (one line, exit 2, when it does
not fit), then runs Lightning's validation on it (which restores the weights, and for
model-heterogeneous methods the client models, and reports the global test accuracy) with the
AnalysisCallback forced on; that callback writes `<run dir>/analysis/round_XXX/` as during fit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Trainer

from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.errors import FLUserError


class FLTrainer(Trainer):
    def analyze(self, model, datamodule=None, ckpt_path: str | None = None, verbose: bool = True):
        """Hessian spectrum and loss surface of a saved checkpoint (needs --ckpt_path).

        Args:
            ckpt_path: the checkpoint to analyse (e.g. <run dir>/checkpoints/last.ckpt).
            verbose: print the validation results.
        """
        if not ckpt_path:
            raise FLUserError("analyze needs --ckpt_path <checkpoint>, e.g. runs/x/checkpoints/last.ckpt")
        callback = next((c for c in self.callbacks if isinstance(c, AnalysisCallback)), None)
        if callback is None:
            raise RuntimeError("analyze needs the AnalysisCallback (the CLI adds it as --analysis)")
        checkpoint = _load(ckpt_path)
        _check_matches(model, checkpoint, ckpt_path)
        callback.forced = True
        callback.checkpoint_round = rounds_in(checkpoint)
        return self.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=verbose)


def rounds_in(checkpoint: dict) -> int:
    """The rounds the checkpointed model has been through: the fit loop's started epochs, which is
    the same whether Lightning saved it at validation end, train-epoch end or train end (its
    `epoch` field differs between those by one)."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["started"])
    except (KeyError, TypeError):
        return int(checkpoint.get("epoch", -1)) + 1


def _load(path: str) -> dict:
    try:
        checkpoint = torch.load(Path(path), map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file: say so in one line
        raise FLUserError(f"--ckpt_path {path}: not a readable checkpoint ({type(err).__name__})") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise FLUserError(f"--ckpt_path {path}: not a Lightning checkpoint (no state_dict)")
    return checkpoint


def _check_matches(model, checkpoint: dict, path: str) -> None:
    """Same tensor names and shapes as the configured method's, or one line naming the first misfit."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    hint = "; give the config.yaml of the run that wrote it"
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        what = f"lacks '{missing[0]}'" if missing else f"has an unexpected '{unexpected[0]}'"
        raise FLUserError(f"--ckpt_path {path} does not match the config: the checkpoint {what} "
                          f"({len(missing)} missing, {len(unexpected)} unexpected tensors){hint}")
    for key, shape in expected.items():
        if saved[key] != shape:
            raise FLUserError(f"--ckpt_path {path} does not match the config: '{key}' has shape "
                              f"{list(saved[key])} in the checkpoint, {list(shape)} in the model{hint}")
