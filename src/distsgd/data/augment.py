"""``--augment``: random crop with padding and horizontal flip, the standard CIFAR recipe (He et
al. 2016, after Lee et al. 2015), for images of the training split only.

Each image is padded by ``padding(H)`` pixels on every side with the value of a black pixel
(after normalisation), a window of its original size is cut at a uniformly random offset, and
the result is mirrored left-right with probability 1/2. On the tensor fast path a whole batch is
augmented at once with tensor indexing; folder datasets augment each image as it is read.
"""

from __future__ import annotations

import torch


def padding(height: int) -> int:
    """4 pixels for 28-32 pixel images (the usual choice), 1 for 8x8: about an eighth of the side."""
    return max(1, round(height / 8))


def crop_flip(x: torch.Tensor, fill: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A randomly cropped (from the padded image) and randomly flipped copy of the batch ``x``
    (B, C, H, W); ``fill`` (1, C, 1, 1) is the padding value of each channel."""
    b, c, h, w = x.shape
    p = padding(h)
    dev = x.device  # on a GPU, the whole augmentation runs there (the draws too, unless a generator is given)
    padded = fill.to(dev, x.dtype).expand(b, c, h + 2 * p, w + 2 * p).clone()
    padded[:, :, p : p + h, p : p + w] = x
    draw_on = None if generator is not None else dev  # None: the default device, the generator's
    dy = torch.randint(0, 2 * p + 1, (b,), generator=generator, device=draw_on).to(dev)
    dx = torch.randint(0, 2 * p + 1, (b,), generator=generator, device=draw_on).to(dev)
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]  # (B, 1, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]  # (B, 1, 1, W)
    out = padded[
        torch.arange(b, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None], rows, cols
    ]
    flip = (torch.rand(b, generator=generator, device=draw_on) < 0.5).to(dev)
    return torch.where(flip[:, None, None, None], out.flip(-1), out)  # a mask's indexing would wait for the GPU
