"""The labelled data set that every labelled source's loader returns (:class:`DataSource`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlore.data.client_data import TensorSplit


@dataclass(frozen=True)
class DataSource:
    """A labelled data set with its official train/test split.

    Attributes:
        name: registry name of the source (``"digits"``, ``"cifar10"``, ...).
        train: training split, images float32 ``[B, C, H, W]`` in [0, 1] (text: int64 token
            ids ``[B, L]``), labels int64 ``[B]``.
        test: the official (central) test split, same layout.
        num_classes: number of classes; labels lie in ``[0, num_classes)``.
        input_shape: shape of one example, ``(C, H, W)`` (text: ``(L,)``).
        class_names: ``num_classes`` human-readable names, index = label.
        task: ``"classification"`` (int64 labels) or ``"regression"`` (float32 targets
            ``[B]``; ``num_classes`` is then the number of target values per example, the
            model's output width, and ``class_names`` names them).
        train_ids: the natural owner of every training example (a writer, a speaker, a LEAF
            user), int64 ``[len(train)]`` indexing ``id_names``; None for a source without one.
            ``partition.name: natural`` gives each id its own client
            (:func:`fedlore.data.partition.partition_natural`).
        test_ids: the same for the test split (None when the source has no ids).
        id_names: the name of each id, index = id (sorted names).
    """

    name: str
    train: TensorSplit
    test: TensorSplit
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str]
    task: str = "classification"
    train_ids: np.ndarray | None = None
    test_ids: np.ndarray | None = None
    id_names: tuple[str, ...] = ()
