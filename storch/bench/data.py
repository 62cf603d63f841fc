"""Data sets of the benchmark: train / valid / test splits of binary (or binarised) images.

* ``digits`` (default): scikit-learn's 8x8 digits, binarized (64 inputs), split 1297 / 250 / 250
  with a fixed permutation. Needs no files.
* ``binarized-mnist``: the static binarization of Larochelle & Murray (50000 / 10000 / 10000),
  `storch.datasets.load_binarized_mnist`.
* ``mnist``: grey MNIST (IDX or ``mnist_uint8.npz``), the last 10000 training images as the
  validation set, binarised dynamically (a fresh Bernoulli draw per training minibatch); the
  evaluation sets are binarised once with a fixed seed.
* ``fashion-mnist``: Fashion-MNIST's IDX files (the same names as MNIST's; Debian's package
  ``dataset-fashion-mnist`` installs them), treated as ``mnist``.

Nothing is downloaded: the files are read from ``--data-dir``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from storch import datasets as sd

__all__ = ["DATASETS", "Dataset", "default_data_dir", "eval_subset", "load_dataset"]

DATASETS = {
    "digits": "scikit-learn's 8x8 digits, binarized (64 pixels); no files needed",
    "binarized-mnist": "statically binarized MNIST (50000/10000/10000) from --data-dir",
    "mnist": "MNIST (IDX or mnist_uint8.npz) from --data-dir, dynamic binarisation, last 10000 train = valid",
    "fashion-mnist": "Fashion-MNIST IDX files from --data-dir, dynamic binarisation, last 10000 train = valid",
}

_FASHION_DIRS = ("/usr/share/dataset-fashion-mnist", "/usr/share/fashion-mnist")


@dataclass
class Dataset:
    name: str
    train: torch.Tensor  # (N, D) in [0, 1]: 0/1 for static data, grey values for dynamic ones
    valid: torch.Tensor  # (N, D) 0/1
    test: torch.Tensor  # (N, D) 0/1
    dynamic: bool = False  # binarise each training minibatch afresh

    @property
    def input_dim(self) -> int:
        return self.train.shape[1]

    @property
    def train_mean(self) -> torch.Tensor:
        return self.train.mean(0)

    def binarize(self, batch: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return sd.dynamic_binarize(batch, generator) if self.dynamic else batch


def default_data_dir(dataset: str = "binarized-mnist") -> Path | None:
    """``../shared/data`` next to the repository (or the working directory), if it exists."""
    if dataset == "fashion-mnist":
        for d in _FASHION_DIRS:
            if Path(d).is_dir():
                return Path(d)
        return None
    here = Path(__file__).resolve().parents[2]
    for base in (here, Path.cwd()):
        candidate = (base / ".." / "shared" / "data").resolve()
        if candidate.is_dir():
            return candidate
    return None


def _split_train_valid(x: torch.Tensor, n_valid: int = 10000):
    return x[:-n_valid], x[-n_valid:]


def eval_subset(x: torch.Tensor, size: int, seed: int = 12345) -> torch.Tensor:
    """A fixed random subset of ``size`` rows (not a prefix: MNIST's first 5000 test images are
    harder than the rest, by about 40 nats under a pixel-mean model)."""
    if size >= x.shape[0]:
        return x
    return x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed), device="cpu")[:size]]


def _fixed_binarize(x: torch.Tensor, seed: int) -> torch.Tensor:
    return sd.dynamic_binarize(x, torch.Generator().manual_seed(seed))


def load_dataset(name: str, data_dir=None) -> Dataset:
    """Load ``name`` (one of `DATASETS`); file-based sets read from ``data_dir``."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "digits":
        x, _ = sd.load_digits_binarized()
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1234), device="cpu")
        x = x[perm]
        return Dataset(name, x[:-500], x[-500:-250], x[-250:])
    if data_dir is None:
        data_dir = default_data_dir(name)
        if data_dir is None:
            raise FileNotFoundError(
                f"data set {name!r} needs --data-dir (no ../shared/data next to the repository"
                + (" and no Debian dataset-fashion-mnist directory" if name == "fashion-mnist" else "")
                + "); storch never downloads data")
    if name == "binarized-mnist":
        return Dataset(name, *(sd.load_binarized_mnist(data_dir, s)[0] for s in ("train", "valid", "test")))
    # mnist and fashion-mnist: same file names and formats (Fashion-MNIST only as IDX files, so that
    # an mnist_uint8.npz in the same folder is never taken for it)
    if name == "fashion-mnist":
        names = ("train-images-idx3-ubyte", "train-images-idx3-ubyte.gz", "train-images.idx3-ubyte",
                 "train-images.idx3-ubyte.gz")
        if not any((Path(data_dir) / n).is_file() for n in names):
            raise FileNotFoundError(
                f"fashion-mnist: no IDX files (train-images-idx3-ubyte[.gz], ...) in {str(data_dir)!r}; "
                "install Debian's dataset-fashion-mnist or pass --data-dir (storch never downloads data)")
    train, _ = sd.load_mnist(data_dir, "train")
    test, _ = sd.load_mnist(data_dir, "test")
    n_valid = 10000 if train.shape[0] > 20000 else max(1, train.shape[0] // 6)
    train, valid = _split_train_valid(train, n_valid)
    return Dataset(name, train, _fixed_binarize(valid, 1), _fixed_binarize(test, 2), dynamic=True)
