"""16-mixed's loss scaling, exercised without a GPU: Lightning's MixedPrecision plugin with a CPU
GradScaler. Scaling by a power of two is exact, so every local-step path must give the same
weights with the scaler as without it (the same autocast, no scaling), unless a path handles
scaled gradients as if they were true ones (SCAFFOLD's correction added before unscaling arrived
2**16 times too small). An overflowing step is skipped and the scale lowered, as for automatic
optimization; the scaler's state is in the checkpoint."""

import pytest
import torch
from fl_test_utils import fit, learnable_shard_module, params
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from fl_lightning.methods import SCAFFOLD, FedAvg, FedProx, FedSAM, FedSOL
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
}


def run(name: str, scaled: bool, clip: float | None = None, **kw):
    torch.manual_seed(0)
    dm = learnable_shard_module(clients=4, sample_ratio=0.5)
    dm.setup()
    method = METHODS[name](dm.spec)
    trainer = fit(method, dm, rounds=2, plugins=[plugin(scaled)], trainer_class=FLTrainer,
                  gradient_clip_val=clip, **kw)
    return params(method), trainer


@pytest.mark.parametrize("name, clip", [("FedAvg", None), ("FedAvg", 0.5), ("FedProx", None), ("SCAFFOLD", None),
                                        ("FedSAM", None), ("FedSOL", None)])
def test_a_local_step_under_the_scaler_equals_the_step_without_it(name, clip):
    scaled, trainer = run(name, scaled=True, clip=clip)
    plain, _ = run(name, scaled=False, clip=clip)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16  # no overflow: no step skipped
    for key, value in plain.items():
        if value.is_floating_point():
            assert torch.allclose(scaled[key].float(), value.float(), rtol=1e-3, atol=1e-4), key


class OverflowOnce(FedAvg):
    """FedAvg whose first local loss overflows float16 once scaled (as a bad batch does on a GPU)."""

    def loss(self, model, batch, context):
        loss = super().loss(model, batch, context)
        if self.local_step == 0 and not getattr(self, "_overflowed", False):
            self._overflowed = True
            return loss * 1e30
        return loss


def test_an_overflowing_step_is_skipped_and_the_scale_lowered(tmp_path):
    torch.manual_seed(0)
    dm = learnable_shard_module(clients=4, sample_ratio=0.25, batch_size=50)  # one client, one step
    dm.setup()
    method = OverflowOnce(data_spec=dm.spec, **OPT)
    start = params(method)
    trainer = fit(method, dm, rounds=1, plugins=[plugin(True)],
                  callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)])
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**15  # halved once
    after = params(method)
    assert all(torch.equal(after[k], start[k]) for k in start)  # the only step was skipped
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["MixedPrecision"]["scale"] == 2.0**15  # the scaler's state is in the checkpoint
