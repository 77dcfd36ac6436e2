"""A tiny two-hidden-layer federation shared by the FedLore synchronization and FedLore-Sketch
tests: four clients of 30, 41, 25 and 36 examples (20 features, 3 classes, shifted by the client
id), rank-2 projections of the two hidden layers, the head trained densely."""

from __future__ import annotations

import torch
from torch import nn

from fedlore.data.client_data import ClientData, TensorSplit

IN, H1, H2, NCLS = 20, 16, 12, 3
RANK = 2
SEED = 5
SIZES = [30, 41, 25, 36]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, H1)
        self.fc2 = nn.Linear(H1, H2)
        self.head = nn.Linear(H2, NCLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def client_data(cid: int) -> ClientData:
    g = torch.Generator().manual_seed(1000 + cid)
    n = SIZES[cid]
    x = torch.randn(n, IN, generator=g) + cid
    y = torch.randint(0, NCLS, (n,), generator=g)
    return ClientData(cid, TensorSplit(x, y), TensorSplit(x[:5], y[:5]))
