"""``folder:PATH``: images read from disk as training goes, not into memory first.

``PATH/train/<class>/*.png|jpg|...`` and ``PATH/test/<class>/...`` (classes are the sub-folder
names, in sorted order; hidden ones, such as Jupyter's ``.ipynb_checkpoints``, are none). Every
training class needs an image. 16-bit grayscale images are scaled to 8 bits, not clipped. Every
image must have the size and channel count of the first; they
are normalised per channel with the mean and standard deviation of up to 512 training images
spread over the set. With ``--augment``, training images are randomly cropped (with padding) and
flipped as they are read. An image that cannot be read, or has another size, stops the run with
one error naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from distsgd.data.augment import crop_flip
from distsgd.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")  # torchvision's
STATS_SAMPLE = 512


def _pil() -> object:
    try:
        from PIL import Image
    except ImportError:
        raise DataError("folder: datasets need Pillow to decode PNG and JPEG: pip install 'distsgd[images]'") from None
    return Image


def list_images(split_dir: Path, classes: list[str] | None = None) -> tuple[list[str], list[int], list[str]]:
    """(files, labels, class names) under ``split_dir/<class>/``."""
    if not split_dir.is_dir():
        raise DataError(f"image folder not found: {split_dir}")
    found = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    training = classes is None  # (a test split takes the training split's classes)
    if classes is None:
        classes = found
    elif set(found) - set(classes):
        raise DataError(f"{split_dir} has classes not in train/: {', '.join(sorted(set(found) - set(classes)))}")
    if not classes:
        raise DataError(f"{split_dir} has no class sub-folders")
    if len(classes) < 2 and training:
        raise DataError(f"{split_dir} has one class sub-folder ({classes[0]}): a classifier needs two or more")
    files, labels = [], []
    for label, name in enumerate(classes):
        folder = split_dir / name
        mine = sorted(f for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        if not mine and training:  # (a test set may lack a class)
            raise DataError(f"{folder} holds no image ({', '.join(IMAGE_SUFFIXES)}): every class needs training images")
        files += [str(f) for f in mine]
        labels += [label] * len(mine)
    if not files:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {split_dir}")
    return files, labels, list(classes)


def read_image(file: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """One image as uint8 (C, H, W); ``shape``: the size every image must have."""
    Image = _pil()
    try:
        with Image.open(file) as img:  # type: ignore[attr-defined]  # _pil() imports PIL.Image lazily: a ModuleType
            gray = img.mode in ("1", "L", "I;16", "I;16B", "I;16L", "I") if shape is None else shape[0] == 1
            if img.mode.startswith("I;16") and gray:  # 16 bits a pixel: scaled, where convert("L") clips at 255
                arr = (np.array(img, dtype=np.uint32) // 257).astype(np.uint8)
            else:
                arr = np.array(img.convert("L" if gray else "RGB"), dtype=np.uint8)
    except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError (a bad PNG chunk),
        # DecompressionBombError (a header claiming billions of pixels), ... for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"cannot read image {file}: {first}") from None
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    if shape is not None and arr.shape != shape:
        raise DataError(
            f"{file} is {arr.shape[1]}x{arr.shape[2]}, but the first image is {shape[1]}x{shape[2]}: "
            f"all images must have one size"
        )
    return arr


class ImageFolder(torch.utils.data.Dataset):
    """One split of a ``folder:`` dataset, each image read when it is asked for."""

    def __init__(
        self, split_dir: Path, classes: list[str] | None = None, stats: tuple | None = None, augment: bool = False
    ) -> None:
        self.files, self.labels, self.classes = list_images(split_dir, classes)
        self.shape = read_image(self.files[0]).shape
        self.mean, self.std = stats if stats is not None else self._stats()
        self.fill = (-self.mean / self.std).view(1, -1, 1, 1)  # a black pixel, normalised
        self.augment = augment

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = np.linspace(0, len(self.files) - 1, min(STATS_SAMPLE, len(self.files))).astype(int)
        sample = torch.from_numpy(np.stack([read_image(self.files[i], self.shape) for i in picks])).double()
        mean = sample.mean(dim=(0, 2, 3))
        std = sample.std(dim=(0, 2, 3)).clamp_min(1e-6) if len(picks) > 1 else torch.ones_like(mean)
        return mean.float(), std.float()

    def split(self, fraction: float) -> tuple["ImageFolder", "ImageFolder"]:
        """(the rest, a held-out ``fraction``): a deterministic split for a folder without test/."""
        import copy

        order = torch.randperm(len(self.files), generator=torch.Generator().manual_seed(0)).tolist()
        n_test = max(1, round(len(order) * fraction))
        parts = []
        for idx in (order[n_test:], order[:n_test]):
            part = copy.copy(self)
            part.files, part.labels = [self.files[i] for i in idx], [self.labels[i] for i in idx]
            parts.append(part)
        return parts[0], parts[1]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.from_numpy(read_image(self.files[i], self.shape)).float()
        x = (x - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)
        if self.augment:
            x = crop_flip(x[None], self.fill)[0]
        return x, self.labels[i]
