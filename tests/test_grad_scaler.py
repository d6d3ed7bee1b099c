"""16-mixed's loss scaling, exercised without a GPU: Lightning's MixedPrecision plugin with a CPU
GradScaler. Scaling by a power of two is exact, so every local-step path must give the same
weights with the scaler as without it (the same autocast, no scaling), unless a path handles
scaled gradients as if they were true ones (SCAFFOLD's correction added before unscaling arrived
2**16 times too small). An overflowing step is skipped and the scale lowered, as for automatic
optimization; the scaler's state is in the checkpoint and a resumed run continues with it.

Steps Lightning does not take itself go through the same scaler (fl_lightning/loss_scaling.py):
Ditto's personal track (its own optimizer, inside the local training's autocast: its float16
gradients underflowed and an overflow stepped v_k to inf) and the gradients FedSAM/FedSOL take for
their perturbation. FedGen's server-side generator trains in the server step, outside autocast, in
float32: nothing to scale. The direct step of clients in parallel runs on 2 gloo processes
(tests/scaler_parallel.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fl_test_utils import fit, learnable_shard_module, params
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from fl_lightning import loss_scaling
from fl_lightning.methods import SCAFFOLD, Ditto, FedAvg, FedGen, FedProx, FedSAM, FedSOL
from fl_lightning.trainer import FLTrainer

OPT = dict(model="mlp", lr=0.05, momentum=0.9, weight_decay=1e-4)


def plugin(scaled: bool) -> MixedPrecision:
    """16-mixed's autocast, with a CPU GradScaler or (the reference) without any: Lightning makes
    one when given none, so it is removed after construction."""
    mixed = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    if not scaled:
        mixed.scaler = None
    return mixed


METHODS = {
    "FedAvg": lambda spec: FedAvg(data_spec=spec, **OPT),
    "FedProx": lambda spec: FedProx(data_spec=spec, mu=0.1, **OPT),
    "SCAFFOLD": lambda spec: SCAFFOLD(data_spec=spec, **OPT),
    "FedSAM": lambda spec: FedSAM(data_spec=spec, rho=0.05, **OPT),
    "FedSOL": lambda spec: FedSOL(data_spec=spec, rho=0.5, **OPT),
    "Ditto": lambda spec: Ditto(data_spec=spec, lam=0.5, **OPT),
    "FedGen": lambda spec: FedGen(data_spec=spec, model="mlp,mlp", feature_dim=8, lr=0.05, server_steps=5),
}


HETERO = ("FedGen",)


def state(method) -> dict[str, torch.Tensor]:
    """The module's state_dict (global model, server state: SCAFFOLD's c, FedGen's generator) and
    every client's kept state (c_i, Ditto's personal model, a heterogeneous client's model)."""
    out = params(method)
    for client in method.client_states:
        out.update({f"client{client}.{k}": v for k, v in method.client_states[client].items()})
    return out


def run(name: str, scaled: bool | None, clip: float | None = None, make=None, **kw):
    """Two rounds on 2 of 4 clients under 16-mixed's autocast, with (scaled) or without the
    scaler; scaled=None: 32-true (no autocast). `make(spec)` builds the method instead of METHODS."""
    torch.manual_seed(0)
    # a model-heterogeneous method evaluates every client on a split of its own data
    split = {"client_test": "split", "client_test_fraction": 0.25} if name in HETERO else {}
    dm = learnable_shard_module(clients=4, sample_ratio=0.5, **split)
    dm.setup()
    method = (make or METHODS[name])(dm.spec)
    precision = {"plugins": [plugin(scaled)]} if scaled is not None else {"precision": "32-true"}
    trainer = fit(method, dm, rounds=2, trainer_class=FLTrainer, gradient_clip_val=clip, **precision, **kw)
    return state(method), trainer, method


def assert_same_states(scaled: dict, plain: dict) -> None:
    assert set(scaled) == set(plain)
    for key, value in plain.items():
        if value.is_floating_point():
            assert torch.allclose(scaled[key].float(), value.float(), rtol=1e-3, atol=1e-4), key


@pytest.mark.parametrize("name, clip", [("FedAvg", None), ("FedAvg", 0.5), ("FedProx", None), ("SCAFFOLD", None),
                                        ("FedSAM", None), ("FedSOL", None), ("Ditto", None), ("Ditto", 0.5),
                                        ("FedGen", None)])
def test_a_local_step_under_the_scaler_equals_the_step_without_it(name, clip):
    scaled, trainer, _ = run(name, scaled=True, clip=clip)
    plain, _, _ = run(name, scaled=False, clip=clip)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16  # no overflow: no step skipped
    assert_same_states(scaled, plain)


class TinyPersonalLoss(Ditto):
    """Ditto whose personal loss is 2**-20 of CE: its float16 activation gradients underflow
    without scaling. Records the gradients its personal optimizer steps with (after unscaling)."""

    def personal_loss(self, batch):
        return super().personal_loss(batch) * 2.0**-20

    def clip_local_gradients(self, optimizer):
        super().clip_local_gradients(optimizer)
        if optimizer is self._personal_opt and not hasattr(self, "first_personal_grads"):
            self.first_personal_grads = [p.grad.detach().clone() for p in self.personal_track.parameters()]


def test_dittos_personal_track_goes_through_the_scaler():
    """Its first step's gradients under 16-mixed's autocast and scaler equal the float32 ones
    within float16 tolerance (before: most underflowed to zero in float16)."""
    def make(spec):
        return TinyPersonalLoss(data_spec=spec, lam=0.0, **OPT)

    scaled, float32 = run("Ditto", scaled=True, make=make)[2], run("Ditto", scaled=None, make=make)[2]
    for got, want in zip(scaled.first_personal_grads, float32.first_personal_grads, strict=True):
        assert want.abs().max() > 0
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_grad_through_the_scaler_keeps_float16_gradients_from_underflowing():
    """loss_scaling.grad (FedSAM's and FedSOL's perturbation directions, Per-FedAvg's inner step)."""
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16):
        tiny = layer(x).float().square().mean() * 2.0**-20
    (want,) = torch.autograd.grad(layer(x).square().mean() * 2.0**-20, [layer.weight])
    (unscaled,) = loss_scaling.grad(tiny, [layer.weight], None, retain_graph=True)
    (got,) = loss_scaling.grad(tiny, [layer.weight], torch.amp.GradScaler("cpu", init_scale=2.0**16))
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert not torch.allclose(unscaled, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


class TinyProximal(FedSOL):
    """FedSOL whose proximal loss is 2**-20 of the KL term, recording the perturbation direction
    g_p of its first perturbed step (step 1: on step 0, w == w_g and the step is plain)."""

    def proximal_loss(self, *args):
        return super().proximal_loss(*args) * 2.0**-20

    def _grads(self, loss, params, retain_graph):
        grads = super()._grads(loss, params, retain_graph)
        if self.local_step == 1 and not hasattr(self, "direction"):
            self.direction = torch.cat([g.detach().reshape(-1) for g in grads])
        return grads


def test_fedsols_perturbation_direction_goes_through_the_scaler():
    """g_p of a small L_p under 16-mixed's autocast and scaler points where the float32 one does
    (before: taken of the unscaled loss, its float16 gradients underflowed)."""
    def make(spec):
        return TinyProximal(data_spec=spec, rho=0.5, min_grad_norm=0.0, **OPT)

    scaled, float32 = run("FedSOL", scaled=True, make=make)[2], run("FedSOL", scaled=None, make=make)[2]
    got, want = scaled.direction.double(), float32.direction.double()
    assert float(want.norm()) > 0  # (~1e-9: cosine_similarity's eps would swamp it)
    assert float(got @ want / (got.norm() * want.norm())) > 0.99


class GeneratorPrecision(FedGen):
    """FedGen recording whether its server-side generator trains under autocast, and in which dtype."""

    def train_generator(self, uploads):
        self.generator_seen = (torch.is_autocast_enabled("cpu"), next(self.generator.parameters()).dtype)
        return super().train_generator(uploads)


def test_fedgens_generator_trains_in_float32_outside_autocast():
    """16-mixed's autocast covers the local training only; the server step (FedGen's generator)
    runs in float32, where there is nothing to scale (its equality under the scaler is above)."""
    def make(spec):
        return GeneratorPrecision(data_spec=spec, model="mlp,mlp", feature_dim=8, lr=0.05, server_steps=5)

    method = run("FedGen", scaled=True, make=make)[2]
    assert method.generator_seen == (False, torch.float32)


class OverflowOnce(FedAvg):
    """FedAvg whose first local loss overflows float16 once scaled (as a bad batch does on a GPU)."""

    def loss(self, model, batch, context):
        loss = super().loss(model, batch, context)
        if self.local_step == 0 and not getattr(self, "_overflowed", False):
            self._overflowed = True
            return loss * 1e30
        return loss


def test_an_overflowing_step_is_skipped_and_the_scale_lowered_and_a_resume_keeps_the_scale(tmp_path):
    torch.manual_seed(0)
    dm = learnable_shard_module(clients=4, sample_ratio=0.25, batch_size=50)  # one client, one step
    dm.setup()
    method = OverflowOnce(data_spec=dm.spec, **OPT)
    start = params(method)
    checkpoints = [ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)]
    trainer = fit(method, dm, rounds=1, plugins=[plugin(True)], callbacks=checkpoints)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**15  # halved once
    after = params(method)
    assert all(torch.equal(after[k], start[k]) for k in start)  # the only step was skipped
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["MixedPrecision"]["scale"] == 2.0**15  # the scaler's state is in the checkpoint
    # resumed with a new scaler at 2**16: it continues from the checkpoint's 2**15 (no overflow in
    # round 2, far from the 2,000 steps after which it would grow), and round 2 steps
    resumed = fit(FedAvg(data_spec=dm.spec, **OPT), dm, rounds=2, plugins=[plugin(True)],
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
                  ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.precision_plugin.scaler.get_scale() == 2.0**15
    assert any(not torch.equal(params(resumed.lightning_module)[k], start[k]) for k in start)


class OverflowOncePersonal(Ditto):
    """Ditto whose first personal-track loss overflows float16 once scaled."""

    def personal_loss(self, batch):
        loss = super().personal_loss(batch)
        if not getattr(self, "_overflowed", False):
            self._overflowed = True
            return loss * 1e30
        return loss


def test_an_overflow_in_dittos_personal_track_skips_its_step_and_lowers_the_scale():
    """Before, the personal optimizer stepped with the inf gradient and v_k became inf/NaN."""
    torch.manual_seed(0)
    dm = learnable_shard_module(clients=4, sample_ratio=0.25, batch_size=50)  # one client, one step
    dm.setup()
    method = OverflowOncePersonal(data_spec=dm.spec, lam=0.5, **OPT)
    start = params(method.model)
    trainer = fit(method, dm, rounds=1, plugins=[plugin(True)])
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**15
    (client,) = list(method.client_states)
    personal = method.client_state(client, "personal.")
    assert all(torch.equal(personal[k], start[k]) for k in start)  # v_k's only step was skipped
    assert any(not torch.equal(params(method.model)[k], start[k]) for k in start)  # the global track stepped


def test_clients_in_parallel_on_two_processes_step_the_same_under_the_scaler(tmp_path):
    """The step of clients in parallel (no DDP wrapper; `sgd_step`'s direct path without a
    scaler) on 2 gloo processes: FedAvg with clipping, SCAFFOLD and Ditto under the scaler equal
    the same runs without it (tests/scaler_parallel.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).parent / "scaler_parallel.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("FedAvg", "SCAFFOLD", "Ditto"):
        scaled, plain = (torch.load(tmp_path / f"{name}_{kind}.pt", weights_only=True) for kind in ("scaled", "plain"))
        assert scaled["scale"] == 2.0**16 and scaled["world_size"] == 2 and scaled["states"]
        assert_same_states(scaled["states"], plain["states"])
    # a step that overflowed on rank 1 alone: both processes end the round with rank 1's lowered
    # scale (the checkpoint holds rank 0's scaler, so they must agree for a resume to continue alike)
    rank0, rank1 = torch.load(tmp_path / "overflow_scalers.pt", weights_only=True)
    assert rank1["scale"] == 2.0**15 and rank0 == rank1
    # the gloo group is destroyed at exit, not left to the interpreter's teardown, which aborted a
    # finished process now and then on a loaded machine (exit -6, "terminate called ...")
    assert [(tmp_path / f"process_group_at_exit_{r}.txt").read_text() for r in (0, 1)] == ["False", "False"]
