"""`--trainer.gradient_clip_val` / `--trainer.gradient_clip_algorithm` under manual optimization.

Lightning refuses them when `automatic_optimization` is off, so the CLI's Trainer (FLTrainer) keeps
them and every local step clips with them (`FederatedMethod.clip_local_gradients`). Each test
writes the clipped step out by hand (one client holding all samples, batch = all, so a round is an
exact number of local steps) and runs it on both of `sgd_step`'s paths: the direct one and
Lightning's wrappers (taken when any callback listens to a per-step hook)."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, reference_sgd, toy_data
from torch.func import functional_call

from fl_lightning.cli import main
from fl_lightning.methods import Ditto, FedAvg, FedSAM
from fl_lightning.trainer import FLTrainer

LR, MOM, WD = 0.1, 0.9, 1e-3


class ListensToSteps(L.Callback):
    """Any per-step hook in a callback sends `sgd_step` through Lightning's wrappers."""

    def __init__(self):
        self.calls = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.calls += 1


def ce_grad(model, x, y):
    def grad_fn(w):
        loss = F.cross_entropy(functional_call(model, w, (x,)), y)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    return grad_fn


def clip_by_norm(g: dict, max_norm: float) -> dict:
    """torch.nn.utils.clip_grad_norm_ written out: scale by max_norm / (||g|| + 1e-6) if below 1."""
    total = math.sqrt(sum(float((v.double() ** 2).sum()) for v in g.values()))
    coef = min(1.0, max_norm / (total + 1e-6))
    return {k: v * coef for k, v in g.items()}


def clip_by_value(g: dict, limit: float) -> dict:
    return {k: v.clamp(-limit, limit) for k, v in g.items()}


def grad_norm(g: dict) -> float:
    return math.sqrt(sum(float((v ** 2).sum()) for v in g.values()))


def setup(method_cls=FedAvg, steps=3, **kw):
    torch.manual_seed(0)
    x, y = toy_data(n=12, size=4, num_classes=3)
    dm = one_client_module(x, y, local_epochs=steps)
    method = method_cls(model="mlp", lr=LR, momentum=MOM, weight_decay=WD, data_spec=dm.spec, **kw)
    w0 = {k: v.detach().clone() for k, v in method.model.named_parameters()}
    return method, dm, x, y, w0


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "lightning-wrappers"])
@pytest.mark.parametrize("algorithm,clip_val", [("norm", 0.05), ("value", 0.002)])
def test_clipped_steps_match_the_hand_written_update(algorithm, clip_val, wrapped):
    method, dm, x, y, w0 = setup(steps=3)
    clip = clip_by_norm if algorithm == "norm" else clip_by_value
    raw = ce_grad(method.model, x, y)
    first = raw({k: v.clone().requires_grad_(True) for k, v in w0.items()})
    if algorithm == "norm":
        assert grad_norm(first) > 4 * clip_val  # the clip is active, not a no-op
    else:
        assert max(float(v.abs().max()) for v in first.values()) > 4 * clip_val

    expected = reference_sgd(w0, lambda w: clip(raw(w), clip_val), 3, LR, MOM, WD)
    unclipped = reference_sgd(w0, raw, 3, LR, MOM, WD)
    assert max_diff(expected, unclipped) > 1e-3
    listener = ListensToSteps()
    fit(method, dm, trainer_class=FLTrainer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm,
        callbacks=[listener] if wrapped else [])
    assert method.steps.direct is not wrapped
    assert listener.calls == (3 if wrapped else 0)
    got = {k: v.detach() for k, v in method.model.named_parameters()}
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)


def test_fedsam_clips_the_perturbed_gradient_it_steps_with():
    rho, clip_val = 0.2, 0.05
    method, dm, x, y, w0 = setup(FedSAM, steps=2, rho=rho)

    def grad_fn(w):  # SAM: the gradient at w + rho g/||g||, then clipped
        g = ce_grad(method.model, x, y)(w)
        norm = grad_norm(g)
        shifted = {k: (w[k].detach() + rho * g[k] / norm).requires_grad_(True) for k in w}
        return clip_by_norm(ce_grad(method.model, x, y)(shifted), clip_val)

    expected = reference_sgd(w0, grad_fn, 2, LR, MOM, WD)
    fit(method, dm, trainer_class=FLTrainer, gradient_clip_val=clip_val)
    got = {k: v.detach() for k, v in method.model.named_parameters()}
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)


def test_ditto_clips_both_tracks():
    """The global track (FedAvg's step) and the personal model v_k (CE + lam/2 prox) are clipped."""
    lam, clip_val = 0.5, 0.05
    method, dm, x, y, w0 = setup(Ditto, steps=2, lam=lam)

    def personal_grad(w):
        loss = F.cross_entropy(functional_call(method.model, w, (x,)), y)
        loss = loss + 0.5 * lam * sum(((w[k] - w0[k]) ** 2).sum() for k in w)
        return clip_by_norm(dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True)), clip_val)

    global_track = reference_sgd(w0, lambda w: clip_by_norm(ce_grad(method.model, x, y)(w), clip_val), 2, LR, MOM, WD)
    personal = reference_sgd(w0, personal_grad, 2, LR, MOM, WD)
    fit(method, dm, trainer_class=FLTrainer, gradient_clip_val=clip_val)
    got = {k: v.detach() for k, v in method.model.named_parameters()}
    for k, v in global_track.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(method.client_state(0, "personal.")[k], personal[k], atol=1e-6, rtol=1e-5)


def test_no_clipping_by_default_and_with_zero():
    method, dm, x, y, w0 = setup(steps=2)
    expected = reference_sgd(w0, ce_grad(method.model, x, y), 2, LR, MOM, WD)
    fit(method, dm, trainer_class=FLTrainer, gradient_clip_val=0)
    got = {k: v.detach() for k, v in method.model.named_parameters()}
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)


# ---- through the CLI --------------------------------------------------------------------------
CLI_ARGS = ["--model", "FedAvg", "--model.init_args.model", "mlp", "--data.dataset", "digits",
            "--data.num_clients", "4", "--data.sample_ratio", "0.5", "--data.local_epochs", "1",
            "--data.min_size", "5", "--trainer.max_epochs", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--federation.eval_local_models", "false"]


def run_cli(args) -> int:
    try:
        main(args)
    except SystemExit as stop:
        return stop.code
    return 0


def final_weights(root) -> dict:
    state = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return state["state_dict"]


def test_cli_gradient_clip_val_changes_the_run(tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("norm", ["--trainer.gradient_clip_val", "0.01"]),
                        ("value", ["--trainer.gradient_clip_val", "0.0005",
                                   "--trainer.gradient_clip_algorithm", "value"])):
        root = tmp_path / name
        assert run_cli(["fit", *CLI_ARGS, "--trainer.default_root_dir", str(root), *extra]) == 0
        runs[name] = final_weights(root)
    start_free = {k for k in runs["plain"] if k.startswith("model.")}
    for clipped in ("norm", "value"):
        diff = max(float((runs[clipped][k] - runs["plain"][k]).abs().max()) for k in start_free)
        assert diff > 1e-4, clipped


@pytest.mark.parametrize("extra,expected", [
    (["--trainer.gradient_clip_algorithm", "sideways", "--trainer.gradient_clip_val", "1"],
     "trainer.gradient_clip_algorithm must be norm or value"),
    (["--trainer.gradient_clip_val", "-1"], "trainer.gradient_clip_val must be a number >= 0"),
])
def test_cli_refuses_bad_clipping_options(tmp_path, capsys, extra, expected):
    code = run_cli(["fit", *CLI_ARGS, "--trainer.default_root_dir", str(tmp_path / "r"), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err and "Traceback" not in err
