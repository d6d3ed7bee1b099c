"""The CLI's Trainer: Lightning's, with gradient clipping under manual optimization and the
`analyze` subcommand (the analyses of `--analysis.*` on a saved checkpoint).

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
from fl_lightning.federation import callback_of


class FLTrainer(Trainer):
    """Lightning's Trainer with two additions: the `analyze` subcommand, and gradient clipping
    under manual optimization.

    Lightning refuses `gradient_clip_val` when `automatic_optimization` is off (every method here
    steps by hand), so this Trainer takes the two clipping options itself, keeps them as
    `local_gradient_clip_val` / `local_gradient_clip_algorithm`, and hands Lightning none; the
    methods clip every local step with them (`FederatedMethod.clip_local_gradients`, through
    Lightning's `clip_gradients`, so precision plugins unscale first).

    Args:
        gradient_clip_val: clip every local step's gradient at this value (None or 0 = off).
        gradient_clip_algorithm: "norm" (the total 2-norm of the trained parameters' gradients is
            scaled down to at most `gradient_clip_val`; the default) or "value" (every gradient
            entry is clamped to [-gradient_clip_val, gradient_clip_val]).
    """

    def __init__(self, gradient_clip_val: int | float | None = None, gradient_clip_algorithm: str | None = None,
                 **kwargs):
        if gradient_clip_val is not None and (isinstance(gradient_clip_val, bool) or
                                              not isinstance(gradient_clip_val, int | float) or
                                              not gradient_clip_val >= 0):
            raise FLUserError(f"--trainer.gradient_clip_val must be a number >= 0 (0 or null = no clipping), "
                              f"got {gradient_clip_val!r}")
        algorithm = (gradient_clip_algorithm or "norm").lower()
        if algorithm not in ("norm", "value"):
            raise FLUserError(f"--trainer.gradient_clip_algorithm must be norm or value, "
                              f"got {gradient_clip_algorithm!r}")
        if str(kwargs.get("precision")) in ("16-mixed", "16") and _runs_on_cpu(kwargs.get("accelerator", "auto")):
            # Lightning would warn and run bf16-mixed, while config.yaml, W&B and the report say 16-mixed
            raise FLUserError("--trainer.precision 16-mixed (float16 autocast with loss scaling) runs on a GPU only: "
                              "on the CPU Lightning would run bf16-mixed in its place; use --trainer.precision "
                              "bf16-mixed (or 32-true) on the CPU")
        super().__init__(**kwargs)
        self.local_gradient_clip_val = float(gradient_clip_val or 0.0)
        self.local_gradient_clip_algorithm = algorithm

    def analyze(self, model, datamodule=None, ckpt_path: str | None = None, verbose: bool = True,
                weights_only: bool | None = None):
        """Hessian spectrum and loss surface of a saved checkpoint (needs --ckpt_path).

        Written to `<run dir>/analysis/posthoc_round_XXX/`, beside (never over) what the fit wrote.

        Args:
            ckpt_path: the checkpoint to analyse (e.g. <run dir>/checkpoints/last.ckpt, or "last").
            verbose: print the validation results.
            weights_only: as for validate and test (a fit's own config.yaml records it, so analyze
                must accept it too).
        """
        if not ckpt_path:
            raise FLUserError("analyze needs --ckpt_path <checkpoint>, e.g. runs/x/checkpoints/last.ckpt")
        callback = callback_of(self, AnalysisCallback)
        if callback is None:
            raise RuntimeError("analyze needs the AnalysisCallback (the CLI adds it as --analysis)")
        callback.forced = True
        callback.checkpoint_round = completed_rounds(load_checkpoint_file(ckpt_path))
        return self.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=verbose,
                             weights_only=weights_only)


def _runs_on_cpu(accelerator) -> bool:
    """Whether Lightning will run on the CPU: asked for, or "auto" on a machine with no GPU, MPS or TPU."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator, XLAAccelerator

    if isinstance(accelerator, CPUAccelerator):
        return True
    if not isinstance(accelerator, str):
        return False
    name = accelerator.lower()
    if name == "auto":
        return not any(a.is_available() for a in (CUDAAccelerator, MPSAccelerator, XLAAccelerator))
    return name == "cpu"
