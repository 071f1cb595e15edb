"""The low-communication benchmark's model: an MLP 784-384-128-10 (352k parameters, 1.4 MB of
float32 gradients a step), big enough that sending its gradients costs more than computing them
on a slow link, small enough to train to 85% on Fashion-MNIST in a minute on 2 cores."""

import math

from torch import nn


class WideMLP(nn.Sequential):
    def __init__(self, input_shape=(1, 28, 28), num_classes=10):
        width = math.prod(input_shape)
        super().__init__(
            nn.Flatten(), nn.Linear(width, 384), nn.ReLU(), nn.Linear(384, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )
