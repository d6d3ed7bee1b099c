"""Stop after round 2 and resume to round 4 gives exactly the uninterrupted 4-round model, from a
checkpoint without the local optimizer's momentum buffers."""

import lightning as L
import torch
from fl_test_utils import fit
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.methods import FedSOL


def make(seed=0):
    L.seed_everything(seed)
    dm = FederatedDataModule(dataset="digits", num_clients=6, sample_ratio=0.5, local_epochs=2, batch_size=50,
                             partition="dirichlet", alpha=0.5, min_size=5)
    method = FedSOL(model="mlp", lr=0.05, rho=0.5, perturb="all", lr_decay=0.9, data_spec=dm.spec)
    return method, dm


def test_resume_matches_uninterrupted_run(tmp_path):
    straight, dm = make()
    fit(straight, dm, rounds=4)

    first, dm = make()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_epochs=1)
    fit(first, dm, rounds=2, callbacks=[ckpt])
    # the round's last client's momentum buffers are not in it (every client starts from zero),
    # its learning rate is
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["optimizer_states"]
    assert len(saved) == 1 and saved[0]["state"] == {}
    assert saved[0]["param_groups"][0]["lr"] == first.current_lr() and first.hparams.momentum > 0
    resumed, dm = make(seed=123)  # a different init: everything must come from the checkpoint
    trainer = fit(resumed, dm, rounds=4, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
                  ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.current_epoch == 4
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.current_lr() == straight.current_lr()
    assert not torch.equal(first.model.state_dict()["head.weight"], straight.model.state_dict()["head.weight"])
