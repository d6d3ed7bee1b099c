"""`--model.memory_format`: channels-last and the default layout train the same models up to
float32 rounding (FedAvg, FedSOL), the layout reaches the weights and the batches the model sees,
an analysis (the Hessian's top eigenvalue) gives the same value on a channels-last model, "auto"
picks the layout by architecture and device, and files are written in the default layout
whatever the option (checkpoints, client-state files) and load into a model of either layout."""

import json

import pytest
import torch
from fl_test_utils import fit, fixed_parts_module, toy_data

from fl_lightning.analysis.callback import AnalysisCallback
from fl_lightning.checkpointing import AtomicCheckpointIO, read_checkpoint
from fl_lightning.client_store import ClientStateStore
from fl_lightning.errors import FLUserError
from fl_lightning.methods import FedAvg, FedORGP, FedSOL
from fl_lightning.models import build_model, memory_format_for
from fl_lightning.models.base import FLModel

CL, DEFAULT = torch.channels_last, torch.contiguous_format
PARTS = [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]


def three_clients():
    """48 RGB 8x8 images over 3 clients: with 3 channels the two layouts differ in memory."""
    x, y = toy_data(n=48, channels=3, size=8, num_classes=3)
    return fixed_parts_module(x, y, PARTS, num_classes=3, batch_size=8, local_epochs=2)


class _SeenLayouts:
    """Records whether every input the model's first convolution saw was channels-last."""

    def __init__(self, model: FLModel):
        self.channels_last: list[bool] = []
        conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        conv.register_forward_pre_hook(lambda module, args: self.channels_last.append(
            args[0].is_contiguous(memory_format=CL) and not args[0].is_contiguous()))


def train(method_cls, memory_format: str, tmp_path, callbacks=(), **kw):
    torch.manual_seed(0)
    dm = three_clients()
    method = method_cls(model="fedavg_cnn", data_spec=dm.spec, memory_format=memory_format, **kw)
    seen = _SeenLayouts(method.model)
    fit(method, dm, rounds=2, callbacks=list(callbacks), default_root_dir=str(tmp_path / memory_format))
    return method, seen


@pytest.mark.parametrize("method_cls,kw", [(FedAvg, {}), (FedSOL, {"rho": 1.0})])
def test_both_layouts_train_the_same_model_to_float32_rounding(tmp_path, method_cls, kw):
    last, seen_last = train(method_cls, "channels_last", tmp_path, **kw)
    default, seen_default = train(method_cls, "contiguous", tmp_path, **kw)
    assert last.memory_format == CL and default.memory_format == DEFAULT
    conv = last.model.state_dict()["body.3.weight"]  # Conv(32 -> 64): its layout is not ambiguous
    assert conv.is_contiguous(memory_format=CL) and not conv.is_contiguous()
    assert seen_last.channels_last and all(seen_last.channels_last)  # training and validation batches
    assert seen_default.channels_last and not any(seen_default.channels_last)
    for key, value in default.model.state_dict().items():
        torch.testing.assert_close(last.model.state_dict()[key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_the_hessians_top_eigenvalue_is_the_same_on_a_channels_last_model(tmp_path):
    values = {}
    for memory_format in ("channels_last", "contiguous"):
        analysis = AnalysisCallback(every_n_rounds=1, samples=30, top_k=2, max_hvps=12, trace_probes=0,
                                    layerwise=False, surface="none", divergence=False, partition=False)
        train(FedAvg, memory_format, tmp_path, callbacks=[analysis])
        result = json.loads((tmp_path / memory_format / "analysis" / "round_002" / "analysis.json").read_text())
        values[memory_format] = result["spectrum"]["lambda_1"]
    assert values["contiguous"] > 0
    assert values["channels_last"] == pytest.approx(values["contiguous"], rel=1e-4)


def test_a_model_heterogeneous_methods_client_models_take_the_layout(tmp_path):
    x, y = toy_data(n=48, channels=3, size=8, num_classes=3)
    torch.manual_seed(0)
    dm = fixed_parts_module(x, y, PARTS, num_classes=3, batch_size=8, client_test_fraction=0.25)
    method = FedORGP(model="mlp,fedavg_cnn", feature_dim=8, data_spec=dm.spec, memory_format="auto")
    fit(method, dm, rounds=1, default_root_dir=str(tmp_path))
    assert method.memory_format == CL  # on a CPU: fedavg_cnn is faster channels-last, mlp has no layout
    conv = method.client_model_copy(1).state_dict()["body.model.body.3.weight"]
    assert conv.is_contiguous(memory_format=CL) and not conv.is_contiguous()


def test_auto_is_channels_last_where_that_is_faster():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert memory_format_for("auto", ["fedavg_cnn"], cpu) == CL
    assert memory_format_for("auto", ["vgg11"], cpu) == DEFAULT  # slower channels-last on a CPU
    assert memory_format_for("auto", ["vgg11"], cuda) == CL
    assert memory_format_for("auto", ["mlp"], cuda) == DEFAULT  # no convolution
    assert memory_format_for("auto", ["cnn4", "googlenet"], cpu) == DEFAULT  # every architecture must gain
    assert memory_format_for("channels_last", ["vgg11"], cpu) == CL
    assert memory_format_for("contiguous", ["fedavg_cnn"], cuda) == DEFAULT
    with pytest.raises(FLUserError, match="memory_format must be one of auto, channels_last, contiguous"):
        FedAvg(data_spec=three_clients().spec, memory_format="nhwc")


def test_checkpoints_and_client_files_are_written_in_the_default_layout(tmp_path):
    model = build_model("fedavg_cnn", three_clients().spec).to(memory_format=CL)
    state = model.state_dict()
    assert not state["body.3.weight"].is_contiguous()
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": state, "optimizer_states": [{"state": {0: {
        "momentum_buffer": state["body.3.weight"].clone()}}}]}, path)
    saved = read_checkpoint(path)
    assert all(t.is_contiguous() for t in saved["state_dict"].values())
    assert saved["optimizer_states"][0]["state"][0]["momentum_buffer"].is_contiguous()
    # the same file as the same model's in the default layout
    default = build_model("fedavg_cnn", three_clients().spec)
    default.load_state_dict(state)
    AtomicCheckpointIO().save_checkpoint({"state_dict": default.state_dict()}, tmp_path / "default.ckpt")
    AtomicCheckpointIO().save_checkpoint({"state_dict": state}, tmp_path / "channels_last.ckpt")
    assert (tmp_path / "default.ckpt").read_bytes() == (tmp_path / "channels_last.ckpt").read_bytes()
    for memory_format in (CL, DEFAULT):  # loads into either layout, keeping the model's own
        other = build_model("fedavg_cnn", three_clients().spec).to(memory_format=memory_format)
        other.load_state_dict(saved["state_dict"])
        assert other.body[3].weight.is_contiguous(memory_format=memory_format)
        assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())
    store = ClientStateStore(tmp_path / "states", cache_size=1)
    store[0] = {"model.w": state["body.3.weight"]}
    store[1] = {"model.w": torch.zeros(1)}  # evicts client 0 to its file
    assert torch.equal(store[0]["model.w"], state["body.3.weight"])
