"""Per-client and server state survive checkpoint/resume bit for bit; a run that blows up stops
(through `trainer.should_stop`, with its outcome recorded) with one line naming round, client and
method, or skips the client when asked to."""

import logging
import re

import pytest
import torch
from fl_test_utils import (
    assert_same_run,
    assert_same_tensors,
    fit,
    four_clients,
    one_client_module,
    straight_and_resumed,
    toy_data,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.cli import main
from fl_lightning.methods import MOON, SCAFFOLD, Ditto, FedAvg, FedDyn, FedExP, FedNTD, FedSOL
from fl_lightning.outcome import Outcome

SERVER_STATE = {SCAFFOLD: "c", FedDyn: "h", FedExP: "iterate", MOON: "initial"}  # their ServerState entries


def stopped(trainer) -> str:
    """The one line of a run its round callback stopped (diverged or failed)."""
    record = trainer.callbacks[0].record
    assert record.stopped and record.outcome in (Outcome.DIVERGED, Outcome.FAILED)
    return record.reason


def build(method_cls, seed=0):
    torch.manual_seed(seed)
    dm = four_clients()
    return method_cls(model="mlp", data_spec=dm.spec), dm


@pytest.mark.parametrize("method_cls", [SCAFFOLD, FedDyn, MOON, FedExP, FedNTD, FedSOL])
def test_resume_equals_uninterrupted(method_cls, tmp_path):
    straight, _, resumed = straight_and_resumed(lambda seed: build(method_cls, seed), tmp_path)
    assert_same_run(straight, resumed)
    if method_cls in SERVER_STATE:
        name = SERVER_STATE[method_cls]
        assert_same_tensors(resumed.server[name], straight.server[name])
    if method_cls is SCAFFOLD:  # the control variates are real, not zeros
        assert len(straight.client_states) >= 2
        assert float(sum(v.abs().sum() for v in straight.server["c"].values())) > 0


def cli_args(tmp_path, *extra):
    return ["fit", "--model", "FedAvg", "--model.model", "mlp", "--model.lr", "1e8",
            "--data.dataset", "digits", "--data.num_clients", "4", "--data.sample_ratio", "0.5",
            "--data.local_epochs", "1",
            "--trainer.max_epochs", "3", "--trainer.logger", "false", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
            "--federation.eval_local_models", "false", *extra]


def test_cli_divergence_stops_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(cli_args(tmp_path))
    assert stop.value.code == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    line = r"error: diverged: non-finite weights at round \d/3, client \d, method FedAvg; .*skip_client"
    assert re.fullmatch(line, errors[0]), errors[0]


def test_cli_skip_client_skips_until_no_client_is_left(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(SystemExit) as stop:
        main(cli_args(tmp_path, "--federation.on_divergence", "skip_client"))
    assert stop.value.code == 3
    out = capsys.readouterr()
    skipped = r"non-finite upload at round \d/3, client \d, method FedAvg: skipping"
    assert re.search(skipped, caplog.text + out.out + out.err)
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "every client's upload was non-finite" in errors[0]


class PoisonedFedAvg(FedAvg):
    """Client 1 uploads NaN weights; the others train normally."""

    def client_end(self):
        upload = super().client_end()
        if upload.client == 1:
            upload.weights["head.bias"] = torch.full_like(upload.weights["head.bias"], float("nan"))
        self.sent.append(upload)
        return upload

    def server_step(self, uploads):
        self.aggregated.append([u.client for u in uploads])
        return super().server_step(uploads)


def poisoned():
    torch.manual_seed(0)
    dm = four_clients()
    method = PoisonedFedAvg(model="mlp", data_spec=dm.spec)
    method.sent, method.aggregated = [], []
    return method, dm


def test_skip_client_drops_only_the_nonfinite_upload():
    method, dm = poisoned()
    trainer = fit(method, dm, rounds=4, on_divergence="skip_client")
    sampled = [[u.client for u in method.sent[2 * r: 2 * r + 2]] for r in range(4)]
    assert any(1 in s for s in sampled) and any(1 not in s for s in sampled)
    assert method.aggregated == [[c for c in s if c != 1] for s in sampled if s != [1]]
    assert all(torch.isfinite(p).all() for p in method.model.parameters())
    assert float(trainer.callback_metrics["clients/skipped"]) in (0.0, 1.0)


def test_stop_names_the_client():
    method, dm = poisoned()
    trainer = fit(method, dm, rounds=4)
    assert re.search(r"round \d/4, client 1, method PoisonedFedAvg", stopped(trainer))


class OverflowingFedAvg(FedAvg):
    def server_step(self, uploads):
        update = super().server_step(uploads)
        update.global_state = {k: v * float("inf") for k, v in update.global_state.items()}
        return update


def test_nonfinite_server_step_stops_the_run_and_is_not_applied():
    torch.manual_seed(0)
    dm = four_clients()
    method = OverflowingFedAvg(model="mlp", data_spec=dm.spec)
    start = {k: v.clone() for k, v in method.model.state_dict().items()}
    trainer = fit(method, dm, rounds=2)
    assert re.search(r"non-finite global model after the server step at round 1/2, method OverflowingFedAvg",
                     stopped(trainer))
    assert_same_tensors(method.model.state_dict(), start)  # back to the round's start, nothing applied


class CollapsingFedAvg(FedAvg):
    """FedAvg whose global model is zeroed from round 3 on: finite weights, one constant prediction."""

    from_round = 2  # 0-based

    def server_step(self, uploads):
        update = super().server_step(uploads)
        if self.trainer.current_epoch >= self.from_round:
            update.global_state = {k: torch.zeros_like(v) for k, v in update.global_state.items()}
        return update


def learnable_clients():
    x, y = toy_data(n=60, size=4, num_classes=3)
    x = 0.3 * x
    x[torch.arange(60), 0, 0, y] += 3.0  # the class is written into the first pixels
    return one_client_module(x, y, num_clients=2, batch_size=10, local_epochs=2)


def test_collapse_to_chance_accuracy_is_reported_as_failed(caplog):
    torch.manual_seed(0)
    dm = learnable_clients()
    method = CollapsingFedAvg(model="mlp", data_spec=dm.spec, lr=0.1)
    with caplog.at_level(logging.INFO):
        trainer = fit(method, dm, rounds=6, federation_kw=dict(collapse_rounds=3))
    federation = trainer.callbacks[0]
    # rounds 1-2 learn, rounds 3-5 sit at the majority share (1/3): failed at round 5, not before
    assert federation.best.value >= 1 / 3 + 0.1
    assert federation.record.marks == {"failed": "round 5/6, method CollapsingFedAvg"}
    assert federation.record.outcome is Outcome.FAILED and not federation.record.stopped  # marked, ran on
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("failed:")]
    assert len(failed) == 1 and "for 3 rounds" in failed[0]


def test_collapse_can_stop_the_run_and_is_off_at_zero():
    torch.manual_seed(0)
    dm = learnable_clients()
    method = CollapsingFedAvg(model="mlp", data_spec=dm.spec, lr=0.1)
    trainer = fit(method, dm, rounds=6, federation_kw=dict(collapse_rounds=2, on_collapse="stop"))
    assert re.fullmatch(r"failed: .* at round 4/6, method CollapsingFedAvg; .*", stopped(trainer))
    assert trainer.current_epoch == 4  # the round that confirmed it completed, nothing after
    dm = learnable_clients()
    trainer = fit(CollapsingFedAvg(model="mlp", data_spec=dm.spec, lr=0.1), dm, rounds=6,
                  federation_kw=dict(collapse_rounds=0))
    assert trainer.callbacks[0].record.marks == {} and trainer.callbacks[0].record.outcome is Outcome.FINISHED


def test_a_slow_start_at_chance_is_not_a_failure():
    torch.manual_seed(0)
    dm = learnable_clients()
    method = CollapsingFedAvg(model="mlp", data_spec=dm.spec, lr=0.1)
    method.from_round = 0  # at chance from the first round on: never learned, so never "failed"
    trainer = fit(method, dm, rounds=4, federation_kw=dict(collapse_rounds=2))
    assert trainer.callbacks[0].record.marks == {}


def test_collapse_state_is_in_the_checkpoint_and_comes_back(tmp_path):
    torch.manual_seed(0)
    dm = learnable_clients()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_epochs=1)
    first = fit(CollapsingFedAvg(model="mlp", data_spec=dm.spec, lr=0.1), dm, rounds=4, callbacks=[ckpt],
                federation_kw=dict(collapse_rounds=3))
    saved = first.callbacks[0].state_dict()
    assert saved["rounds_at_chance"] == 2 and saved["marks"] == {}
    dm = learnable_clients()
    resumed = fit(CollapsingFedAvg(model="mlp", data_spec=dm.spec, lr=0.1), dm, rounds=5,
                  ckpt_path=str(tmp_path / "last.ckpt"), federation_kw=dict(collapse_rounds=3),
                  callbacks=[ModelCheckpoint(dirpath=tmp_path / "again", save_last=True, save_top_k=0)])
    # the third round at chance is the resumed run's first: counted on top of the restored two
    assert resumed.callbacks[0].state_dict()["marks"] == {"failed": "round 5/5, method CollapsingFedAvg"}


class PoisonedLateDitto(Ditto):
    """Client 1's upload is NaN from round 3 on, after it has kept a personal model earlier."""

    def round_start(self, round_idx, clients):
        super().round_start(round_idx, clients)
        if round_idx == 2:  # what the clients kept after rounds 1-2
            self.kept_before = {c: self.client_state(c, "personal.") for c in self.client_states}

    def client_end(self):
        upload = super().client_end()
        if upload.client == 1 and self.round_idx >= 2:
            upload.weights["head.bias"] = torch.full_like(upload.weights["head.bias"], float("nan"))
        return upload


def test_a_skipped_client_keeps_its_previous_kept_state():
    torch.manual_seed(0)
    dm = one_client_module(*toy_data(n=40, size=4, num_classes=3), num_clients=2, batch_size=10)
    method = PoisonedLateDitto(model="mlp", data_spec=dm.spec)
    fit(method, dm, rounds=4, on_divergence="skip_client")
    # client 0 keeps a new personal model every round; client 1's was kept only while accepted
    assert_same_tensors(method.client_state(1, "personal."), method.kept_before[1])
    assert not torch.equal(method.client_state(0, "personal.")["head.bias"], method.kept_before[0]["head.bias"])
