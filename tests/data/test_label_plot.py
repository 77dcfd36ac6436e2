"""The per-client label-distribution plot: the counts it is drawn from, the bars and the heat
map holding exactly those counts, the PNG written atomically, and ``fedlore partition --plot``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.container import BarContainer
from matplotlib.image import AxesImage

from fedlore.cli import main
from fedlore.config import load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.data.label_plot import label_counts, label_figure, save_label_plot

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fed() -> Federation:
    return build_federation(load_config(None, ["num_clients=4", "partition.alpha=0.3"]), 5)


def test_the_counts_are_the_histogram_with_class_names(fed: Federation) -> None:
    counts, names = label_counts(fed)
    assert np.array_equal(counts, fed.histogram()) and counts.shape == (4, 10)
    assert names == [str(d) for d in range(10)]
    assert counts.sum() == sum(len(t) for t in fed.train_indices)
    by_hand = [np.bincount(fed.pool.y.numpy()[t], minlength=10) for t in fed.train_indices]
    assert np.array_equal(counts, np.stack(by_hand))


def test_stacked_bars_hold_the_counts(fed: Federation) -> None:
    counts, names = label_counts(fed)
    ax = label_figure(fed, "bars").axes[0]
    assert len(ax.containers) == 10
    for k, bars in enumerate(ax.containers):
        assert isinstance(bars, BarContainer)
        assert bars.get_label() == names[k]
        assert [round(p.get_height()) for p in bars.patches] == counts[:, k].tolist()
        # stacked: class k starts on top of classes 0 .. k-1
        assert [round(p.get_y()) for p in bars.patches] == counts[:, :k].sum(axis=1).tolist()


def test_the_heat_map_holds_the_counts(fed: Federation) -> None:
    counts, _ = label_counts(fed)
    ax = label_figure(fed, "heatmap").axes[0]
    image = next(a for a in ax.get_children() if isinstance(a, AxesImage))
    assert np.array_equal(np.asarray(image.get_array()), counts.T)
    auto = label_figure(fed).axes[0]  # 10 classes: bars
    assert len(auto.containers) == 10


def test_a_png_is_written_atomically(fed: Federation, tmp_path: Path) -> None:
    out = save_label_plot(fed, tmp_path / "labels.png")
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.png"]  # no temporary left


def test_partition_plot_writes_one_file_per_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "dist.png"
    assert main(["partition", "num_clients=3", "seeds=[1]", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(PNG)
    assert f"label distribution written to {plot}" in capsys.readouterr().out
    assert main(["partition", "--plot", str(plot), "num_clients=3", "seeds=[1,2]"]) == 0
    assert (tmp_path / "dist-seed1.png").is_file() and (tmp_path / "dist-seed2.png").is_file()
    capsys.readouterr()
    assert main(["partition", "num_clients=3", "--plot", str(tmp_path / "no" / "x.png")]) == 2
    err = capsys.readouterr()
    assert f"the folder {tmp_path / 'no'} does not exist" in err.err and "# " not in err.out
    assert main(["partition", "num_clients=3", "--plot", ""]) == 2
    assert "give an image file name, e.g. --plot labels.png" in capsys.readouterr().err
    assert main(["partition", "num_clients=3", "--plot", str(tmp_path)]) == 2
