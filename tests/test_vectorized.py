"""The vectorised engine (`--federation.engine vectorized`): a round's clients trained together
give what the sequential engine gives, to float32 rounding (a batched matrix product sums in
another order), for every method that declares support; what it cannot run is refused in one
line naming the sequential engine."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from fl_test_utils import assert_same_tensors, fit, fixed_parts_module, toy_data
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.cli import main
from fl_lightning.federation import federation_of
from fl_lightning.methods import FedAvg, FedProx, FedSOL
from fl_lightning.vectorized import sgd_update

# float32 tolerances for two rounds of a few local steps: weights 1e-6 (the measured differences
# are below 1e-7); logged values 5e-6 (measured below 1e-6: FedSOL's cosines of small gradients
# are the most sensitive)
ATOL, RTOL = 1e-6, 1e-6
METRIC_TOL = 5e-6

# client sizes 7, 14, 3, 9 with batch 4 and 2 local epochs: 4, 8, 2 and 6 steps (the last two
# steps one client's alone), and at the epochs' last steps batches of 3, 2, 3 and 1 samples, so a
# step mixes batch shapes
PARTS = [range(0, 7), range(7, 21), range(21, 24), range(24, 33)]


class Rounds(L.Callback):
    """Each round's logged metrics (without perf/*, a run's own clock) and per-client rows."""

    def __init__(self):
        self.metrics, self.clients = [], []
        self.start: dict[str, torch.Tensor] = {}
        self.global_steps = 0

    def on_train_start(self, trainer, pl_module):
        self.start = {k: v.clone() for k, v in pl_module.model.state_dict().items()}

    def on_train_end(self, trainer, pl_module):
        self.global_steps = trainer.global_step

    @property
    def trained_away_from_start(self) -> bool:
        return bool(self.metrics) and all(not torch.equal(v, self.end[k]) for k, v in self.start.items())

    def on_train_epoch_end(self, trainer, pl_module):
        report = federation_of(trainer).round_report
        self.metrics.append({k: v for k, v in report.metrics.items() if not k.startswith("perf/")})
        self.clients.append(copy.deepcopy(report.clients))
        self.end = {k: v.clone() for k, v in pl_module.model.state_dict().items()}


def run(method_class, engine, rounds=2, callbacks=(), ckpt_path=None, group=0, model="mlp", trainer_kw=None, **kw):
    x, y = toy_data(n=33, size=4, num_classes=3)
    dm = fixed_parts_module(x, y, PARTS, batch_size=4, local_epochs=2)
    torch.manual_seed(0)
    method = method_class(model=model, lr=0.05, momentum=0.9, weight_decay=1e-3, data_spec=dm.spec, **kw)
    recorder = Rounds()
    fit(method, dm, rounds=rounds, eval_local_models=True, callbacks=[recorder, *callbacks], ckpt_path=ckpt_path,
        federation_kw={"engine": engine, "engine_group": group}, **(trainer_kw or {}))
    return method, recorder


def assert_close_runs(a, b):
    (method_a, rounds_a), (method_b, rounds_b) = a, b
    sa, sb = method_a.model.state_dict(), method_b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=ATOL, rtol=RTOL)
    assert rounds_a.global_steps == rounds_b.global_steps > 0  # every client's steps counted
    assert len(rounds_a.metrics) == len(rounds_b.metrics)
    for ma, mb in zip(rounds_a.metrics, rounds_b.metrics, strict=True):
        assert ma.keys() == mb.keys()
        for k in ma:
            assert ma[k] == pytest.approx(mb[k], rel=METRIC_TOL, abs=METRIC_TOL), k
    for ca, cb in zip(rounds_a.clients, rounds_b.clients, strict=True):
        assert [r.keys() for r in ca] == [r.keys() for r in cb]
        for ra, rb in zip(ca, cb, strict=True):
            for k in ra:
                assert ra[k] == pytest.approx(rb[k], rel=METRIC_TOL, abs=METRIC_TOL), k


@pytest.mark.parametrize(("method_class", "kw"), [
    (FedAvg, {}), (FedProx, {"mu": 0.5}),
    (FedSOL, {"rho": 0.5}),  # the paper's default: head perturbation, KL proximal loss, layer-adaptive
    (FedSOL, {"rho": 0.5, "perturb": "all", "adaptive": "none", "proximal": "l2", "cosine_scope": "all"}),
    (FedSOL, {"rho": 0.5, "perturb": "body", "adaptive": "dim0", "cosine_scope": "all"}),
], ids=["FedAvg", "FedProx", "FedSOL", "FedSOL-all-l2", "FedSOL-body"])
def test_vectorized_equals_sequential_over_two_rounds(method_class, kw):
    sequential = run(method_class, "sequential", **kw)
    vectorized = run(method_class, "vectorized", **kw)
    assert sequential[1].trained_away_from_start
    assert "train/loss" in sequential[1].metrics[-1] and "train_loss" in sequential[1].clients[-1][0]
    assert_close_runs(sequential, vectorized)


def test_the_fedavg_papers_2nn_trains_alike_on_both_engines():
    """`mlp_2nn` is McMahan et al.'s MNIST 2NN, 784-200-200-10 with ReLU: 199,210 parameters."""
    from fl_lightning.data.datasets import DataSpec
    from fl_lightning.models import build_model

    model = build_model("mlp_2nn", DataSpec(num_classes=10, in_channels=1, image_size=28))
    assert sum(p.numel() for p in model.parameters()) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10 == 199_210
    assert_close_runs(run(FedAvg, "sequential", model="mlp_2nn"), run(FedAvg, "vectorized", model="mlp_2nn"))


def test_clients_trained_in_groups_equal_sequential():
    """`engine_group 3`: the round's 4 clients train as a group of 3, then a group of 1."""
    assert_close_runs(run(FedProx, "sequential", mu=0.5), run(FedProx, "vectorized", group=3, mu=0.5))


def test_a_convolutional_model_stacked_over_clients_equals_sequential():
    """The FedAvg CNN in the run's layout (channels-last on a CPU), its clients stacked on request
    (`engine_group 0`): vmap's grouped convolutions give the sequential engine's results."""
    sequential = run(FedAvg, "sequential", model="fedavg_cnn")
    stacked = run(FedAvg, "vectorized", model="fedavg_cnn", group=0)
    assert sequential[0].model.body[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert_close_runs(sequential, stacked)
    assert not all(torch.equal(v, stacked[0].model.state_dict()[k])
                   for k, v in sequential[0].model.state_dict().items())  # stacked: not the same kernels


def test_by_default_a_convolutional_models_clients_train_one_at_a_time_on_a_cpu(caplog):
    """Without `engine_group`, a model with convolutions on a CPU trains its clients one after the
    other with the sequential engine's step (its stacked convolutions are slower there): the
    sequential run's weights to the bit, and one line that says so."""
    sequential, _ = run(FedAvg, "sequential", model="fedavg_cnn")
    with caplog.at_level("INFO"):
        alone, _ = run(FedAvg, "vectorized", model="fedavg_cnn", group=None)
    assert_same_tensors(alone.model.state_dict(), sequential.model.state_dict())
    assert "the clients of model 'fedavg_cnn' train one at a time on a CPU" in caplog.text
    stacked, _ = run(FedAvg, "vectorized", model="mlp", group=None)  # no convolution: stacked
    reference, _ = run(FedAvg, "sequential", model="mlp")
    assert not all(torch.equal(v, stacked.model.state_dict()[k]) for k, v in reference.model.state_dict().items())


def test_batches_made_by_the_data_module_or_listed_per_client_train_alike(monkeypatch):
    """The stacked batches a step gathers at once from its clients' sample indices
    (`FederatedDataModule.samples`) are the clients' own mini-batches: the same run, to the bit,
    as with each client's batches from `minibatches` stacked (the path of augmented data)."""
    from fl_lightning.data.datamodule import FederatedDataModule

    gathered, _ = run(FedProx, "vectorized", mu=0.5)
    monkeypatch.setattr(FederatedDataModule, "samples_from_indices", property(lambda self: False))
    listed, _ = run(FedProx, "vectorized", mu=0.5)
    assert_same_tensors(gathered.model.state_dict(), listed.model.state_dict())


# bf16-mixed: both engines' forward passes in bfloat16 under autocast, whose rounding (8 bits of
# mantissa) two orders of summation meet at about 1e-3 after two rounds (measured up to 9.6e-4)
BF16_TOL = 5e-3


@pytest.mark.parametrize(("method_class", "kw"), [(FedAvg, {}), (FedSOL, {"rho": 0.5})], ids=["FedAvg", "FedSOL"])
def test_bf16_mixed_trains_alike_on_both_engines_under_autocast(method_class, kw):
    bf16 = {"precision": "bf16-mixed"}
    sequential = run(method_class, "sequential", trainer_kw=bf16, **kw)[0].model.state_dict()
    vectorized = run(method_class, "vectorized", trainer_kw=bf16, **kw)[0].model.state_dict()
    in_float32 = run(method_class, "vectorized", **kw)[0].model.state_dict()
    for k, v in sequential.items():
        torch.testing.assert_close(vectorized[k], v, atol=BF16_TOL, rtol=0)
    # the vectorised step did run under bf16 autocast
    assert max(float((vectorized[k] - in_float32[k]).abs().max()) for k in vectorized) > 1e-5


def test_loss_scaling_is_refused_in_one_line():
    """16-mixed on a GPU scales the loss with a GradScaler whose scale passes from one client's
    steps to the next's: refused (the CPU's GradScaler stands in for the GPU's)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from fl_lightning.errors import FLUserError

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(FLUserError, match=r"^--federation.engine vectorized does not scale losses .*"
                                          r"use --federation.engine sequential$"):
        run(FedAvg, "vectorized", trainer_kw={"plugins": [plugin]})


def test_stacked_sgd_is_torch_sgd():
    """Each row of the stacked update is torch.optim.SGD's step for that client (momentum from a
    zero buffer, coupled weight decay), over several steps with different gradients per row."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(5, 3, generator=g) for _ in range(3)]
    own = [torch.nn.Parameter(r.clone()) for r in rows]
    optimizers = [torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=1e-2) for p in own]
    stacked = {"w": torch.stack(rows)}
    buffers = {"w": torch.zeros_like(stacked["w"])}
    for _ in range(4):
        grads = torch.randn(3, 5, 3, generator=g)
        for p, opt, grad in zip(own, optimizers, grads, strict=True):
            p.grad = grad.clone()
            opt.step()
        sgd_update(stacked, {"w": grads}, buffers, lr=0.1, momentum=0.9, weight_decay=1e-2)
    for i, p in enumerate(own):
        torch.testing.assert_close(stacked["w"][i], p.detach(), atol=1e-6, rtol=0)


def test_resumed_vectorized_run_equals_an_uninterrupted_one(tmp_path):
    """2 rounds, a checkpoint, resumed into a fresh module to 3 rounds: the same weights, to the bit,
    as 3 rounds straight (the engine keeps nothing between rounds that a checkpoint would miss)."""
    kw = {"rho": 0.5}
    straight, _ = run(FedSOL, "vectorized", rounds=3, **kw)
    run(FedSOL, "vectorized", rounds=2, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
        **kw)
    torch.manual_seed(123)  # the resumed module starts elsewhere: everything comes from the checkpoint
    resumed, rounds = run(FedSOL, "vectorized", rounds=3, ckpt_path=str(tmp_path / "last.ckpt"),
                          callbacks=[ModelCheckpoint(dirpath=tmp_path / "again", save_last=True, save_top_k=0)], **kw)
    assert [m["round"] for m in rounds.metrics] == [3.0]
    assert_same_tensors(resumed.model.state_dict(), straight.model.state_dict())


REPO = Path(__file__).resolve().parents[1]
BASE = ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--data.dataset", "digits",
        "--model.init_args.model", "mlp", "--trainer.max_epochs", "1", "--trainer.logger", "false",
        "--data.num_clients", "4", "--federation.engine", "vectorized"]

REFUSED = [
    (["--model", "SCAFFOLD"], ["does not support SCAFFOLD"]),
    (["--model", "FedSOLMOON"], ["does not support FedSOLMOON", "it changes"]),
    (["--model", "FedSOL", "--model.init_args.strategy", "A4"], ["FedSOL with strategy A4"]),
    (["--model", "FedAvg", "--model.init_args.model", "mlp_bn"], ["model 'mlp_bn'", "BatchNorm"]),
    (["--model", "FedAvg", "--model.init_args.constraint", "joint"], ["FedCONST"]),
    (["--model", "FedAvg", "--trainer.gradient_clip_val", "1.0"], ["gradient_clip_val"]),
    (["--model", "FedProx", "--trainer.precision", "bf16-true", "--data.num_clients", "4"],
     ["32-true, 64-true and bf16-mixed", "bf16-true"]),
]


@pytest.mark.parametrize("extra, needles", REFUSED, ids=[" ".join(e) for e, _ in REFUSED])
def test_what_cannot_run_vectorised_is_refused_in_one_line(extra, needles, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", *BASE, *extra, "--trainer.default_root_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert stop.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: --federation.engine vectorized "), err
    assert lines[0].endswith("use --federation.engine sequential"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_one_backward_pass_only_where_the_declaring_class_gives_the_loss():
    """FedAvg's step is the gradient of the sum of its clients' losses (one backward pass); a
    method whose loss tests `requires_grad` (FedProx) or a FedAvg subclass with a loss of its own
    takes `vmap` of `torch.func.grad`; both give FedAvg's equality with the sequential engine."""
    from fl_lightning.vectorized import _one_backward

    class OwnLoss(FedAvg):
        def loss(self, model, batch, context):
            return super().loss(model, batch, context) * 2

    spec = fixed_parts_module(*toy_data(n=33, size=4, num_classes=3), PARTS, batch_size=4).spec
    assert _one_backward(FedAvg(model="mlp", data_spec=spec))
    assert not _one_backward(FedProx(model="mlp", data_spec=spec))
    assert not _one_backward(OwnLoss(model="mlp", data_spec=spec))


def test_fedsols_kl_over_a_padded_batch_is_the_kl_of_its_real_samples():
    """FedSOL's batches are padded to one size like FedAvg's: its KL proximal term averages over
    the real samples only, which is the unpadded batch's KL; a subclass with a proximal term of its
    own is not padded (its term may average over the padding)."""
    from fl_lightning.methods.fedsol.fedsol import kl_proximal_loss

    g = torch.Generator().manual_seed(0)
    logits, global_logits = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    padded = torch.cat([logits, torch.zeros(2, 3)]), torch.cat([global_logits, torch.randn(2, 3, generator=g)])
    valid = torch.tensor([True] * 5 + [False] * 2)
    torch.testing.assert_close(kl_proximal_loss(*padded, 3.0, valid), kl_proximal_loss(logits, global_logits, 3.0))
    assert not torch.allclose(kl_proximal_loss(*padded, 3.0), kl_proximal_loss(logits, global_logits, 3.0))

    class OwnProximal(FedSOL):
        def proximal_loss(self, x, features, logits, params):
            return super().proximal_loss(x, features, logits, params) * 2

    spec = fixed_parts_module(*toy_data(n=33, size=4, num_classes=3), PARTS, batch_size=4).spec
    assert FedSOL(model="mlp", data_spec=spec).vectorized_padding
    assert not OwnProximal(model="mlp", data_spec=spec).vectorized_padding
