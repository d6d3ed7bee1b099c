"""Datasets held as tensors on the training device, and the papers' augmentation on whole batches.

Every dataset of the papers fits in memory (CIFAR-10's 50,000 training images are 150 MB as
uint8), so the round's mini-batches are sliced from tensors on the device instead of being
decoded and collated sample by sample in a DataLoader: that per-sample work, not the arithmetic,
was most of a small model's step time. Images decoded from 8-bit files are kept as uint8 and
converted (`/255`, then normalised) per batch, with the same operations in the same order as
torchvision's `ToTensor` + `Normalize`, so the batches are bit-identical to the DataLoader's.

Augmentation (random crop with zero padding + horizontal flip, per sample) is drawn from a
generator seeded by (seed, round, client) alone, never from global RNG state, so a client's
batches do not depend on which clients ran before it or on which process runs it.
torchvision.transforms.v2 draws one crop per call (the same for a whole batch) and kornia draws
from the global RNG, so neither fits; `crop_flip` below is the few lines it takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch


def client_generator(seed: int, round_idx: int, client: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose draws depend only on (seed, round, client)."""
    state = np.random.SeedSequence([seed, round_idx, client]).generate_state(1, np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)


def draw_crop_flip(batch_size: int, padding: int, generator: torch.Generator,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: (top, left) offsets in [0, 2 * padding] of the crop in the padded image, and
    whether it is flipped horizontally."""
    offsets = torch.randint(0, 2 * padding + 1, (batch_size, 2), generator=generator, device=device)
    flips = torch.randint(0, 2, (batch_size,), generator=generator, device=device).bool()
    return offsets, flips


def crop_flip(images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, padding: int) -> torch.Tensor:
    """RandomCrop(size, padding, fill 0) then RandomHorizontalFlip, with the given draws, for a
    whole (B, C, H, W) batch in one gather."""
    b, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
    device = images.device
    rows = offsets[:, 0, None] + torch.arange(h, device=device)  # (B, H)
    cols = torch.arange(w, device=device).expand(b, w)
    cols = torch.where(flips[:, None], cols.flip(1), cols) + offsets[:, 1, None]  # (B, W)
    batch_idx = torch.arange(b, device=device)[:, None, None, None]
    channel_idx = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch_idx, channel_idx, rows[:, None, :, None], cols[:, None, None, :]]


@dataclass(frozen=True)
class TensorImages:
    """A whole dataset as two tensors. `images` is either float (already what the model sees) or
    uint8 (`/255` and `(x - mean) / std` per batch); `augment` applies crop + flip per sample."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    augment: bool = False
    padding: int = 4
    memory_format: torch.memory_format = torch.contiguous_format  # of the batches `finish` makes

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device | str) -> TensorImages:
        if self.images.device == torch.device(device):
            return self
        return replace(self, images=self.images.to(device), labels=self.labels.to(device))

    def without_augmentation(self) -> TensorImages:
        return replace(self, augment=False)

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored images and labels of `idx` (on the device), before `finish`."""
        return self.images.index_select(0, idx), self.labels.index_select(0, idx)

    def finish(self, images: torch.Tensor, generator: torch.Generator | None = None,
               share: slice | torch.Tensor | None = None) -> torch.Tensor:
        """Stored images -> what the model sees: crop + flip (drawn for the whole batch, then
        `share` of it is kept, so the draws do not depend on how many processes share the batch),
        then uint8 -> float in [0, 1] -> normalised, as ToTensor + Normalize compute it, in the
        layout `memory_format`."""
        if self.augment:
            if generator is None:
                raise ValueError("augmented batches need a seeded generator")
            offsets, flips = draw_crop_flip(len(images), self.padding, generator, images.device)
            if share is not None:
                images, offsets, flips = images[share], offsets[share], flips[share]
            images = crop_flip(images, offsets, flips, self.padding)
        elif share is not None:
            images = images[share]
        if self.memory_format != torch.contiguous_format:  # before the conversion, which keeps it
            images = images.contiguous(memory_format=self.memory_format)
        if images.dtype != torch.uint8:
            return images
        x = images.to(torch.get_default_dtype()).div(255)
        if self.mean is not None:
            mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
            x = x.sub(mean).div(std)
        return x

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `idx` as the model sees them (augmented if `augment`)."""
        images, labels = self.take(idx)
        return self.finish(images, generator), labels

    def sequential_batches(self, batch_size: int, indices: torch.Tensor | None = None):
        """Unaugmented batches in order (evaluation)."""
        images = self.images if indices is None else self.images.index_select(0, indices)
        labels = self.labels if indices is None else self.labels.index_select(0, indices)
        plain = self.without_augmentation()
        return [(plain.finish(images[s : s + batch_size]), labels[s : s + batch_size])
                for s in range(0, len(labels), batch_size)]
