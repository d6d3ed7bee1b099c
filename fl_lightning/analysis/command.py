"""`fl-lightning analyze`: the analyses of `--analysis.*` on a saved checkpoint.

LightningCLI builds one subcommand per Trainer method, so `analyze` is a method of a Trainer
subclass. The CLI has already refused a damaged checkpoint or one of another experiment
(`checkpointing.check_compatible`); `analyze` runs Lightning's validation on it (which restores
the weights, and for model-heterogeneous methods the client models, and reports the global test
accuracy) with the AnalysisCallback forced on, which writes `<run dir>/analysis/round_XXX/` as
during fit.
"""

from __future__ import annotations

from lightning.pytorch import Trainer

from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.checkpointing import completed_rounds, load_checkpoint_file
from fl_lightning.errors import FLUserError


class FLTrainer(Trainer):
    def analyze(self, model, datamodule=None, ckpt_path: str | None = None, verbose: bool = True):
        """Hessian spectrum and loss surface of a saved checkpoint (needs --ckpt_path).

        Args:
            ckpt_path: the checkpoint to analyse (e.g. <run dir>/checkpoints/last.ckpt, or "last").
            verbose: print the validation results.
        """
        if not ckpt_path:
            raise FLUserError("analyze needs --ckpt_path <checkpoint>, e.g. runs/x/checkpoints/last.ckpt")
        callback = next((c for c in self.callbacks if isinstance(c, AnalysisCallback)), None)
        if callback is None:
            raise RuntimeError("analyze needs the AnalysisCallback (the CLI adds it as --analysis)")
        callback.forced = True
        callback.checkpoint_round = completed_rounds(load_checkpoint_file(ckpt_path))
        return self.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=verbose)
