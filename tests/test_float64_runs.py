"""`--trainer.precision 64-true` through the CLI, as a user runs an invariant check: the per-round
analyses run in float64, a resumed float64 run is bit-identical to an uninterrupted one (Lightning
restores a checkpoint before converting the module, which rounded it through float32), and
FedCONST's constraints hold to 1e-12 on the stored global weights across rounds and resumes."""

import shutil

import torch
from test_cli import REPO, run

SETTING = ["--config", str(REPO / "configs/settings/mnist5k.yaml"),
           "--config", str(REPO / "configs/methods/fedsol/fedavg.yaml")]
CONST = ["--config", str(REPO / "configs/methods/fedconst/const.yaml")]
FLOAT64 = ["--data.dataset", "digits", "--model.init_args.model", "mlp", "--data.num_clients", "10",
           "--data.min_size", "5", "--trainer.precision", "64-true", "--trainer.logger", "false",
           "--trainer.enable_progress_bar", "false"]
TINY = [*FLOAT64, "--federation.eval_local_models", "false"]


def model_weights(ckpt) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}


def worst_constraint_cosine(after: dict, before: dict) -> tuple[float, float]:
    """Over every output channel c of every weight matrix that moved: max |1^T D_c| / ||D_c|| and
    max |w_c^T D_c| / (||w_c|| ||D_c||), with D = after - before (float64)."""
    centre = orth = 0.0
    for name, w in before.items():
        if w.dim() < 2:
            continue
        w, d = w.reshape(len(w), -1).double(), (after[name] - before[name]).reshape(len(w), -1).double()
        moved = d.norm(dim=1) > 0
        d, w = d[moved], w[moved]
        centre = max(centre, float((d.sum(1).abs() / d.norm(dim=1)).max()))
        orth = max(orth, float(((w * d).sum(1).abs() / (w.norm(dim=1) * d.norm(dim=1))).max()))
    return centre, orth


def test_a_float64_run_runs_its_analyses_in_float64(tmp_path):
    """Defect 1: the analyses at the end of round 1 and the local models' evaluation after every
    client (on by default) fed float32 batches to the float64 model and crashed the run."""
    root = tmp_path / "run"
    analyses = ["--analysis.every_n_rounds", "1", "--analysis.top_k", "2", "--analysis.samples", "100",
                "--analysis.max_hvps", "10", "--analysis.surface_points", "3", "--analysis.heatmap_every_n_rounds", "1"]
    assert run(["fit", *SETTING, *CONST, *FLOAT64, *analyses, "--federation.local_eval_samples", "100",
                "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(root)]) == 0
    assert all(v.dtype == torch.float64 for v in model_weights(root / "checkpoints" / "last.ckpt").values())
    assert (root / "analysis" / "round_002" / "analysis.json").exists()


def test_fedconst_holds_to_1e12_in_a_float64_run_and_a_resume_is_bit_identical(tmp_path):
    resumed, straight, control = tmp_path / "resumed", tmp_path / "straight", tmp_path / "control"
    assert run(["fit", *SETTING, *CONST, *TINY, "--trainer.max_epochs", "1",
                "--trainer.default_root_dir", str(resumed)]) == 0
    shutil.copy(resumed / "checkpoints" / "last.ckpt", tmp_path / "round1.ckpt")
    assert run(["fit", *SETTING, *CONST, *TINY, "--trainer.max_epochs", "2", "--ckpt_path", "last",
                "--trainer.default_root_dir", str(resumed)]) == 0
    assert run(["fit", *SETTING, *CONST, *TINY, "--trainer.max_epochs", "2",
                "--trainer.default_root_dir", str(straight)]) == 0
    round1 = model_weights(tmp_path / "round1.ckpt")
    round2 = model_weights(resumed / "checkpoints" / "last.ckpt")
    assert all(torch.equal(round2[k], v) for k, v in model_weights(straight / "checkpoints" / "last.ckpt").items())
    centre, orth = worst_constraint_cosine(round2, round1)
    assert centre < 1e-12 and orth < 1e-12, (centre, orth)
    # the same check on an unconstrained run is far from zero: it can fail
    assert run(["fit", *SETTING, *TINY, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(control)]) == 0
    shutil.copy(control / "checkpoints" / "last.ckpt", tmp_path / "control2.ckpt")
    assert run(["fit", *SETTING, *TINY, "--trainer.max_epochs", "1", "--overwrite", "true",
                "--trainer.default_root_dir", str(control)]) == 0
    centre, orth = worst_constraint_cosine(model_weights(tmp_path / "control2.ckpt"),
                                           model_weights(control / "checkpoints" / "last.ckpt"))
    assert centre > 1e-3 and orth > 1e-3


def test_norms_and_losses_of_a_float64_run_are_taken_in_float64():
    """FedSOL's and FedSAM's perturbation radius, ProximalProjection's coefficient and the
    analyses' loss were computed in float32 (`.float()`) inside float64 runs: right to ~1e-8 only."""
    from fl_lightning.analysis.objective import cross_entropy_sum
    from fl_lightning.methods.baselines.fedsam import sam_perturbation
    from fl_lightning.methods.fedsol.fedsol import project_out_conflict, sol_perturbation

    g = torch.Generator().manual_seed(0)
    w, grad, wg = (torch.randn(40, 30, generator=g, dtype=torch.float64) for _ in range(3))
    (eps,) = sol_perturbation([w], [grad], [wg], rho=0.7, adaptive="none")
    torch.testing.assert_close(eps, 0.7 * grad / (grad.norm() + 1e-12), rtol=1e-14, atol=0)
    (eps,) = sam_perturbation([w], [grad], 0.7, adaptive=False)
    torch.testing.assert_close(eps, 0.7 * grad / (grad.norm() + 1e-12), rtol=1e-14, atol=0)
    conflicting = -grad + 1e-3 * w
    (out,), projected = project_out_conflict([conflicting], [grad])
    assert projected
    want = conflicting - (conflicting * grad).sum() / (grad * grad).sum() * grad
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-14)
    logits, y = torch.randn(50, 10, generator=g, dtype=torch.float64), torch.arange(50) % 10
    torch.testing.assert_close(cross_entropy_sum(logits, y),
                               -torch.log_softmax(logits, dim=1)[torch.arange(50), y].sum(), rtol=1e-14, atol=0)
