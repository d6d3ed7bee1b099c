"""Model registry. Every model is an `FLModel`: `features(x)` gives the penultimate representation
and `head` maps it to logits, because head-perturbation (FedSOL), contrastive (MOON), frozen
classifiers (FedDr+, FedBABU) and prototype methods all need that split."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError, unknown_name
from fl_lightning.models.base import FLModel
from fl_lightning.models.cnn import FedAvgCNN
from fl_lightning.models.lenet import LeNet5
from fl_lightning.models.mlp import MLP, TwoNN
from fl_lightning.models.mobilenet import CifarMobileNet
from fl_lightning.models.resnet import CifarResNet
from fl_lightning.models.vgg import VGG11

MODELS: dict[str, Callable[..., FLModel]] = {
    # The FedAvg CNN; its flatten size follows the input size (3136 for 28x28, 4096 for 32x32).
    "fedavg_cnn": lambda spec, **kw: FedAvgCNN(spec.in_channels, spec.num_classes, spec.image_size, **kw),
    # The heterogeneous-model papers' "4-layer CNN": the same CNN without padding.
    "cnn4": lambda spec, **kw: FedAvgCNN(spec.in_channels, spec.num_classes, spec.image_size, padding=0, **kw),
    "vgg11": lambda spec, **kw: VGG11(spec.in_channels, spec.num_classes, spec.image_size, **kw),
    "resnet18": lambda spec, **kw: CifarResNet(spec.in_channels, spec.num_classes, **kw),
    # MobileNet v1 for 32x32 (FedBABU/FedDr+ on CIFAR-100); 1024 features.
    "mobilenet": lambda spec, **kw: CifarMobileNet(spec.in_channels, spec.num_classes, **kw),
    "mlp": lambda spec, **kw: MLP(spec.in_channels * spec.image_size**2, spec.num_classes, **kw),
    "mlp_bn": lambda spec, **kw: MLP(spec.in_channels * spec.image_size**2, spec.num_classes, batch_norm=True, **kw),
    # The FedAvg paper's MNIST "2NN": 784-200-200-10 with ReLU.
    "mlp_2nn": lambda spec, **kw: TwoNN(spec.in_channels * spec.image_size**2, spec.num_classes, **kw),
    # FedCONST's models: no batch norm, no biases (every weight is a constrained channel matrix).
    "lenet5": lambda spec, **kw: LeNet5(spec.in_channels, spec.num_classes, spec.image_size, **kw),
    "lenet5_nobias": lambda spec, **kw: LeNet5(spec.in_channels, spec.num_classes, spec.image_size,
                                               bias=False, **kw),
    "resnet18_nobn_nobias": lambda spec, **kw: CifarResNet(spec.in_channels, spec.num_classes, norm="none",
                                                           bias=False, head_bias=False, **kw),
}


# The memory layout of the weights and the batches (`--model.memory_format`, methods/base.py): in
# "channels_last" a convolution reads and writes each pixel's channels together, the layout
# oneDNN's and cuDNN's fastest kernels for most convolutions use; "contiguous" is torch's default
# (channels outermost). The numbers are the same up to float rounding. With "auto" a convolutional
# model runs channels-last on CUDA and, on a CPU, the architectures below, whose local step is
# faster there in that layout (benchmarks/channels_last.py measures each); on a CPU the others
# (VGG-11's 3x3 convolutions, torchvision's networks) keep the default layout.
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")
CHANNELS_LAST_ON_CPU = {"fedavg_cnn", "cnn4", "lenet5", "lenet5_nobias", "mobilenet", "resnet18",
                        "resnet18_nobn_nobias"}
FULLY_CONNECTED = {"mlp", "mlp_bn", "mlp_2nn"}  # no convolution: the layout changes nothing


def check_memory_format(option: str) -> None:
    """Refuses, in one line, a `--model.memory_format` that is none of MEMORY_FORMATS."""
    if option not in MEMORY_FORMATS:
        raise FLUserError(f"--model.memory_format must be one of {', '.join(MEMORY_FORMATS)}, got '{option}'")


def memory_format_for(option: str, architectures: Iterable[str], device: torch.device) -> torch.memory_format:
    """The layout `option` means for models of `architectures` trained on `device`."""
    check_memory_format(option)
    convolutional = [a for a in architectures if a not in FULLY_CONNECTED]
    if option == "contiguous" or not convolutional:
        return torch.contiguous_format
    if option == "channels_last" or device.type == "cuda":
        return torch.channels_last
    if device.type == "cpu" and all(a in CHANNELS_LAST_ON_CPU for a in convolutional):
        return torch.channels_last
    return torch.contiguous_format


_FITS: set[tuple[str, DataSpec]] = set()  # (model, data) pairs a forward pass has been checked on


def build_model(name: str, spec: DataSpec, **kwargs) -> FLModel:
    """The architecture `name` for data of `spec`; one line, not a shape traceback, when its layers
    cannot take the data's images (a 5x5 convolution without padding on 8x8 digits, say)."""
    if name not in MODELS:
        raise unknown_name("model", name, MODELS)
    try:
        model = MODELS[name](spec, **kwargs)
        if (name, spec) not in _FITS:
            _forward_once(model, spec)
            _FITS.add((name, spec))
    except (RuntimeError, ValueError) as err:
        fits = [m for m in sorted(MODELS) if m != name and _fits(m, spec)]
        reason = str(err).strip().splitlines()[0][:160]
        size = f"{spec.in_channels}x{spec.image_size}x{spec.image_size}"
        raise FLUserError(f"model {name} cannot take {size} images ({reason}); models that can: {', '.join(fits)} "
                          f"(or --data.resize to a larger size)") from None
    return model


def _forward_once(model: nn.Module, spec: DataSpec) -> None:
    """One forward pass of two zero images in eval mode (no parameter, buffer or RNG changes)."""
    import torch

    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(2, spec.in_channels, spec.image_size, spec.image_size))
    finally:
        for m, training in flags:
            m.training = training


def _fits(name: str, spec: DataSpec) -> bool:
    import torch

    with torch.random.fork_rng(devices=[]):  # building a model draws its initial weights
        try:
            _forward_once(MODELS[name](spec), spec)
            return True
        except (RuntimeError, ValueError):
            return False


def register_model(name: str, factory: Callable[..., FLModel], channels_last_on_cpu: bool = False,
                   convolutional: bool = True) -> None:
    """Lets a method family add its own architectures (e.g. FedCONST's bias-free variants);
    `channels_last_on_cpu` when its local step is faster channels-last on a CPU (see
    CHANNELS_LAST_ON_CPU), `convolutional=False` when it has no convolution."""
    MODELS[name] = factory
    if channels_last_on_cpu:
        CHANNELS_LAST_ON_CPU.add(name)
    if not convolutional:
        FULLY_CONNECTED.add(name)


__all__ = ["FLModel", "MEMORY_FORMATS", "MODELS", "build_model", "check_memory_format", "memory_format_for",
           "register_model", "nn"]
