"""The client-state store: a bounded cache over per-client files. Eviction never changes results,
a checkpoint writes only the states that changed (bytes scale with participation), and a run
killed at any moment (here: mid-round, and between writing the state files and the checkpoint)
resumes to exactly the uninterrupted run."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from fl_test_utils import assert_same_run, assert_same_tensors, fit, one_client_module, toy_data
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.client_store import ClientStateStore
from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.methods import SCAFFOLD, FedORGP, FedProto, LGFedAvg
from fl_lightning.models.hetero import PooledFeatureModel


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), value), "n": torch.tensor(int(value))}


def test_bounded_cache_writes_evicted_states_and_reads_them_back(tmp_path):
    store = ClientStateStore(tmp_path, cache_size=1)
    for c in range(3):
        store[c] = state(c + 0.5)
    assert len(list(tmp_path.glob("client*.safetensors"))) == 2  # clients 0 and 1 were evicted
    for c in (0, 2, 1):
        assert torch.equal(store[c]["w"], state(c + 0.5)["w"]) and int(store[c]["n"]) == c
    assert set(store) == {0, 1, 2} and 5 not in store and store.get(5) is None


def test_checkpoint_writes_only_changed_states_and_keeps_what_the_last_two_checkpoints_name(tmp_path):
    store = ClientStateStore(tmp_path)
    for c in range(4):
        store[c] = state(c)
    first = store.checkpoint_state()
    assert len(first["manifest"]) == 4
    written = store.bytes_written
    store[1] = state(10.0)  # one client trained
    second = store.checkpoint_state()

    def file(record):  # a manifest entry: [name in the store's folder, size, checksum]
        return tmp_path / record[0]

    assert store.bytes_written - written == file(second["manifest"][1]).stat().st_size  # only client 1
    assert second["manifest"][0] == first["manifest"][0]
    assert file(first["manifest"][1]).exists()  # the previous checkpoint may still be the one on disk
    store[1] = state(11.0)
    third = store.checkpoint_state()
    assert not file(first["manifest"][1]).exists()  # named by neither of the last two checkpoints
    assert file(second["manifest"][1]).exists()
    resumed = ClientStateStore(tmp_path)
    resumed.load_checkpoint_state(third)
    assert float(resumed[1]["w"][0]) == 11.0 and float(resumed[3]["w"][0]) == 3.0


def _scaffold_run(cache_size, root, rounds=3):
    torch.manual_seed(0)
    x, y = toy_data(n=60, size=4, num_classes=3)
    dm = one_client_module(x, y, num_clients=6, sample_ratio=0.5, batch_size=5, local_epochs=2)
    method = SCAFFOLD(model="mlp", lr=0.05, data_spec=dm.spec)
    fit(method, dm, rounds=rounds, federation_kw={"client_cache_size": cache_size}, default_root_dir=root)
    return method


def test_a_checkpoint_with_blake2b_checksums_still_resumes_and_still_refuses_damage(tmp_path):
    """Checkpoints of the version before CRC-32 record blake2b digests: they are checked with it."""
    import hashlib

    from fl_lightning.client_store import ClientStateError

    store = ClientStateStore(tmp_path)
    for c in range(2):
        store[c] = state(c + 0.5)
    saved = store.checkpoint_state()
    assert all(record[2].startswith("crc32:") for record in saved["manifest"].values())
    for record in saved["manifest"].values():  # as the previous version recorded them
        record[2] = hashlib.blake2b((tmp_path / record[0]).read_bytes(), digest_size=16).hexdigest()
    resumed = ClientStateStore(tmp_path)
    resumed.load_checkpoint_state(saved)
    resumed.verify()
    assert torch.equal(resumed[1]["w"], state(1.5)["w"])
    path = tmp_path / saved["manifest"][0][0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    damaged = ClientStateStore(tmp_path)
    damaged.load_checkpoint_state(saved)
    with pytest.raises(ClientStateError, match="does not match its checksum"):
        damaged[0]


def test_a_cache_of_one_gives_the_same_run_as_an_unlimited_cache(tmp_path):
    unlimited = _scaffold_run(0, tmp_path / "a")
    one = _scaffold_run(1, tmp_path / "b")
    assert len(unlimited.client_states) >= 3
    assert len(one.client_states._cache) == 1
    assert any((tmp_path / "b" / "client_states").glob("client*.safetensors"))
    assert_same_run(unlimited, one)


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from fl_test_utils import fit, one_client_module, toy_data
    from fl_lightning.methods import SCAFFOLD

    torch.set_num_threads(1)
    moment, ckpt_dir = sys.argv[1], sys.argv[2]

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if moment == "mid_round" and trainer.current_epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    class KillingSCAFFOLD(SCAFFOLD):
        def on_save_checkpoint(self, checkpoint):
            super().on_save_checkpoint(checkpoint)  # the round's state files are written now
            if moment == "before_checkpoint_file" and self.current_epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    x, y = toy_data(n=60, size=4, num_classes=3)
    dm = one_client_module(x, y, num_clients=6, sample_ratio=0.5, batch_size=5, local_epochs=2)
    method = KillingSCAFFOLD(model="mlp", lr=0.05, data_spec=dm.spec)
    fit(method, dm, rounds=4, callbacks=[Kill(), ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1)],
        federation_kw={{"client_cache_size": 1}})
""")


@pytest.mark.parametrize("moment", ["mid_round", "before_checkpoint_file"])
def test_a_run_killed_at_any_moment_resumes_every_client_state_exactly(tmp_path, moment):
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(__file__).parent)))
    ckpt_dir = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([sys.executable, str(script), moment, str(ckpt_dir)], env=env, capture_output=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["epoch"] == 1  # rounds 1-2 checkpointed

    straight = _scaffold_run(0, tmp_path / "straight", rounds=4)
    torch.manual_seed(123)  # everything must come from the checkpoint and the state files
    x, y = toy_data(n=60, size=4, num_classes=3)
    dm = one_client_module(x, y, num_clients=6, sample_ratio=0.5, batch_size=5, local_epochs=2)
    resumed = SCAFFOLD(model="mlp", lr=0.05, data_spec=dm.spec)
    fit(resumed, dm, rounds=4, ckpt_path=str(ckpt_dir / "last.ckpt"), federation_kw={"client_cache_size": 1},
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1)])
    assert_same_run(straight, resumed)


class BytesPerCheckpoint(ModelCheckpoint):
    """Client-model bytes written by each round's checkpoint (between two rounds' starts)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.marks = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.marks.append(pl_module.client_states.bytes_written)

    def on_train_end(self, trainer, pl_module):
        self.marks.append(pl_module.client_states.bytes_written)

    @property
    def written(self):
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def test_checkpoint_bytes_per_round_scale_with_the_clients_that_trained(tmp_path):
    """Heterogeneous client models: after the first checkpoint, a round writes the models of the
    clients that trained, not all of them."""
    per_round = {}
    for ratio in (0.2, 1.0):
        torch.manual_seed(0)
        x, y = toy_data(n=200, size=4, num_classes=3)
        dm = one_client_module(x, y, num_classes=3, num_clients=10, sample_ratio=ratio, batch_size=10,
                               client_test_fraction=0.25)
        method = FedProto(model="mlp", feature_dim=8, data_spec=dm.spec)
        checkpoint = BytesPerCheckpoint(dirpath=tmp_path / str(ratio), save_last=True, every_n_epochs=1)
        fit(method, dm, rounds=3, callbacks=[checkpoint])
        per_round[ratio] = checkpoint.written
    one_model = per_round[1.0][0] / 10
    assert per_round[1.0][0] == pytest.approx(10 * one_model) and per_round[0.2][0] == pytest.approx(10 * one_model)
    for later in (1, 2):  # 2 of 10 clients trained
        assert per_round[0.2][later] == pytest.approx(2 * one_model, rel=0.05)
        assert per_round[1.0][later] == pytest.approx(10 * one_model, rel=0.05)


# ---- heterogeneous client models live in the store ----------------------------------------------
class CountsLiveClientModels(L.Callback):
    """After every client: the client models alive as modules, and the weights held in memory."""

    def __init__(self):
        self.modules, self.cached = [], []

    def on_train_batch_end(self, trainer, pl_module, *args):
        gc.collect()
        self.modules.append(sum(isinstance(o, PooledFeatureModel) for o in gc.get_objects()))
        self.cached.append(len(pl_module.client_states._cache))


def _hetero_digits_run(method_cls, cache_size, root, rounds=2, callbacks=(), ckpt_path=None):
    torch.manual_seed(0)
    dm = FederatedDataModule(dataset="digits", num_clients=6, sample_ratio=0.5, local_epochs=1, batch_size=16,
                             partition="dirichlet", alpha=0.5, min_size=10, client_test_fraction=0.25)
    method = method_cls(model="mlp,fedavg_cnn", feature_dim=8, lr=0.05, data_spec=dm.spec)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_epochs=1)
    fit(method, dm, rounds=rounds, federation_kw={"client_cache_size": cache_size},
        callbacks=[*callbacks, checkpoint], ckpt_path=ckpt_path)
    return method


def _client_weights(method) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in method.client_models]


@pytest.mark.parametrize("method_cls", [FedORGP, LGFedAvg])
def test_heterogeneous_client_models_live_in_the_store(tmp_path, method_cls):
    """A cache of one client gives the same run as an unlimited cache, and with it at most one
    client's weights and one module per architecture (2 here, for 6 clients) are in memory."""
    counter = CountsLiveClientModels()
    one = _hetero_digits_run(method_cls, 1, tmp_path / "one", callbacks=[counter])
    unlimited = _hetero_digits_run(method_cls, 0, tmp_path / "all")
    assert max(counter.cached) <= 1
    assert max(counter.modules) <= 2, counter.modules  # the architectures' modules, not 6 clients'
    assert len(list((tmp_path / "one" / "ckpt" / "client_states").glob("client*.safetensors"))) >= 6
    for a, b in zip(_client_weights(one), _client_weights(unlimited), strict=True):
        assert_same_tensors(a, b)
    assert_same_tensors(one.state_dict(), unlimited.state_dict())  # the server state too


def test_resume_with_a_bounded_cache_restores_every_client_model(tmp_path):
    straight = _hetero_digits_run(LGFedAvg, 1, tmp_path / "straight", rounds=3)
    _hetero_digits_run(LGFedAvg, 1, tmp_path / "interrupted", rounds=2)
    torch.manual_seed(123)
    resumed = _hetero_digits_run(LGFedAvg, 1, tmp_path / "interrupted", rounds=3,
                                 ckpt_path=str(tmp_path / "interrupted" / "ckpt" / "last.ckpt"))
    for a, b in zip(_client_weights(straight), _client_weights(resumed), strict=True):
        assert_same_tensors(a, b)


def test_sync_publishes_states_evicted_during_the_round(tmp_path):
    """Two processes over one directory (a fake two-rank collective): rank 1 trains clients 3 and
    4 with a cache of 1, so client 3's new state is evicted to a file before the round ends; after
    `sync`, rank 0 reads both clients' new states from rank 1's files."""
    from fl_lightning.client_store import ClientStateStore

    rank0, rank1 = ClientStateStore(tmp_path, cache_size=1), ClientStateStore(tmp_path, cache_size=1)
    for store in (rank0, rank1):  # the state every process loaded from the last checkpoint
        store[3] = {"c": torch.zeros(2)}
        store.checkpoint_state()
    rank1[3] = {"c": torch.full((2,), 3.0)}
    rank1[4] = {"c": torch.full((2,), 4.0)}  # evicts client 3: written to a file, no longer dirty

    class Collective:
        distributed = True

        def __init__(self, rank, other):
            self.rank, self.other, self.sent = rank, other, None

        def gather(self, obj):
            self.sent = obj
            return [obj, self.other] if self.rank == 0 else [self.other, obj]

    one = Collective(1, (0, {}))
    rank1.sync(one)
    assert set(one.sent[1]) == {3, 4}  # both published, the evicted one too
    rank0.sync(Collective(0, one.sent))
    assert float(rank0[3]["c"][0]) == 3.0 and float(rank0[4]["c"][0]) == 4.0
