"""Data sets for discrete-latent models: a bundled default and loaders for standard files.

* `storch.datasets.load_digits_binarized` -- scikit-learn's 8x8 digits, binarized. They
  ship inside the package, so examples and tests run anywhere without data files or extras.
* `storch.datasets.load_mnist` -- grey-scale MNIST (LeCun et al.) from the original IDX files
  (``train-images-idx3-ubyte`` ..., plain or ``.gz``) or from ``mnist_uint8.npz``.
* `storch.datasets.load_binarized_mnist` -- the fixed ("static") binarization of Larochelle & Murray
  (2011), train/valid/test = 50000/10000/10000, from the original ``binarized_mnist_{split}.amat`` text
  files or from ``binarized_mnist_packed.npz`` (``np.packbits`` rows).
* `storch.datasets.load_omniglot` -- the 28x28 Omniglot of the IWAE paper (``chardata.mat``).
* `storch.datasets.dynamic_binarize` -- draw Bernoulli(x) pixels, redrawn for every minibatch ("dynamic"
  binarization); a loader cannot do this once and for all, so it is a separate step.
* `storch.datasets.minibatches` -- iterate over (shuffled) minibatches of one or several tensors.
* `random_subset` -- a random subset of rows, to evaluate on part of a split (never a prefix: the
  binarized MNIST test split is sorted by digit).
* `storch.datasets.read_idx` / `storch.datasets.write_idx` -- the IDX file format.

Every loader reads from a directory the caller names and never downloads anything; a missing file
raises `FileNotFoundError` that names the directory, the files looked for and how to get them.

This module depends only on the standard library, numpy and torch (scipy is imported lazily by
the function that needs it).
"""

from __future__ import annotations

import gzip
import os
from importlib import resources
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "load_digits_binarized",
    "load_mnist",
    "load_binarized_mnist",
    "load_omniglot",
    "dynamic_binarize",
    "minibatches",
    "random_subset",
    "read_idx",
    "write_idx",
]

PathLike = Union[str, "os.PathLike[str]"]

# IDX type codes (third byte of the magic number) and their big-endian numpy dtypes.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {(dt.kind, dt.itemsize): code for code, dt in _IDX_DTYPES.items()}

_GZIP_MAGIC = b"\x1f\x8b"

_MNIST_HINT = (
    "storch never downloads data. Put the four MNIST IDX files (train-images-idx3-ubyte, "
    "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, optionally .gz) "
    "from http://yann.lecun.com/exdb/mnist/ or a mirror into this directory, or an "
    "mnist_uint8.npz with arrays x_train, y_train, x_test, y_test, and pass the directory."
)
_BINARIZED_HINT = (
    "storch never downloads data. Put binarized_mnist_{train,valid,test}.amat (Larochelle & "
    "Murray 2011) or binarized_mnist_packed.npz (arrays train, valid, test of np.packbits rows) "
    "into this directory and pass the directory."
)
_OMNIGLOT_HINT = (
    "storch never downloads data. Put chardata.mat (the 28x28 Omniglot of Burda et al.'s IWAE "
    "repository, datasets/OMNIGLOT/chardata.mat) into this directory and pass the directory."
)


# --------------------------------------------------------------------------------------------
# IDX format
# --------------------------------------------------------------------------------------------


def _open_maybe_gzip(path: Path):
    with open(path, "rb") as f:
        head = f.read(2)
    return gzip.open(path, "rb") if head == _GZIP_MAGIC else open(path, "rb")


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST format), plain or gzip-compressed, into a numpy array.

    The header is two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions, then one big-endian uint32 per
    dimension; the data follow, big-endian, in C order. Compression is detected from the content,
    not the file name.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from storch.datasets import read_idx, write_idx
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "tiny-idx2-ubyte.gz")
        ...     write_idx(path, np.arange(6, dtype=np.uint8).reshape(2, 3))
        ...     read_idx(path)
        array([[0, 1, 2],
               [3, 4, 5]], dtype=uint8)
    """
    path = Path(path)
    with _open_maybe_gzip(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file: the magic number must start with two zero bytes")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: IDX header truncated ({len(raw)} bytes for {ndim} dimensions)")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX header says shape {shape} of {dtype.name} ({expected} bytes of data) "
            f"but the file holds {len(raw) - header} bytes after the header"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def write_idx(path: PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file; gzip-compressed when ``path`` ends in ``.gz``.

    Supported dtypes: uint8, int8, int16, int32, float32, float64 (see `storch.datasets.read_idx`).

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from storch.datasets import read_idx, write_idx
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_idx(os.path.join(d, "labels-idx1-ubyte"), np.array([7, 2, 1], np.uint8))
        ...     read_idx(os.path.join(d, "labels-idx1-ubyte")).tolist()
        [7, 2, 1]
    """
    array = np.asarray(array)
    key = (array.dtype.kind, array.dtype.itemsize)
    if key not in _IDX_CODES:
        raise ValueError(f"IDX cannot store dtype {array.dtype}; use one of uint8, int8, int16, "
                         "int32, float32, float64")
    code = _IDX_CODES[key]
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(header + payload)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _check_split(split: str, allowed: Sequence[str], what: str) -> None:
    if split not in allowed:
        raise ValueError(f"{what}: split must be one of {', '.join(map(repr, allowed))}, got {split!r}")


def _check_directory(directory: PathLike, what: str, hint: str) -> Path:
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{what}: directory {str(directory)!r} does not exist. {hint}")
    return directory


def _find(directory: Path, names: Sequence[str]) -> Optional[Path]:
    for name in names:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    return None


def _idx_names(stem: str) -> list:
    # The canonical names, then the dotted variant some mirrors use ("train-images.idx3-ubyte").
    dotted = stem.replace("-idx", ".idx")
    return [stem, stem + ".gz", dotted, dotted + ".gz"]


# --------------------------------------------------------------------------------------------
# data sets
# --------------------------------------------------------------------------------------------


def load_digits_binarized(threshold: float = 8.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (``load_digits``), binarized: pixel = 1 where grey value >= ``threshold``.

    The grey values are integers 0..16; the default threshold 8 keeps the strokes (about 40% of
    the pixels are on). This is the project's default data set: its 1797 images ship inside the
    package (``storch/_data/digits.npz``, 45 kB; UCI's "Optical Recognition of Handwritten Digits"
    test set, Alpaydin & Kaynak 1998, CC BY 4.0), so it needs neither a download nor scikit-learn.

    Returns:
        ``(images, labels)``: float32 tensor of 0/1 of shape (1797, 64) and int64 labels 0..9.

    Examples:
        >>> from storch.datasets import load_digits_binarized
        >>> x, y = load_digits_binarized()
        >>> x.shape, x.dtype, y.shape, y.dtype
        (torch.Size([1797, 64]), torch.float32, torch.Size([1797]), torch.int64)
        >>> sorted(x.unique().tolist())
        [0.0, 1.0]
    """
    with (resources.files("storch") / "_data" / "digits.npz").open("rb") as f, np.load(f) as arrays:
        grey, labels = arrays["images"], arrays["labels"]
    images = torch.from_numpy(grey >= threshold).to(torch.float32)
    return images, torch.from_numpy(labels).to(torch.int64)


def load_mnist(directory: PathLike, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
    """Grey-scale MNIST from a directory: images scaled to [0, 1] and labels.

    Looks in ``directory`` for the original IDX files, ``{prefix}-images-idx3-ubyte`` and
    ``{prefix}-labels-idx1-ubyte`` with ``prefix`` = ``train`` or ``t10k`` (each optionally
    ``.gz``; the dotted names ``train-images.idx3-ubyte`` are accepted too), and otherwise for
    ``mnist_uint8.npz`` with arrays ``x_train``, ``y_train``, ``x_test``, ``y_test``.

    For a binary likelihood, either binarize each minibatch with
    `storch.datasets.dynamic_binarize`, or use
    the standard fixed binarization from `storch.datasets.load_binarized_mnist`.

    Args:
        directory: the folder holding the files.
        split: ``"train"`` (60000 images) or ``"test"`` (10000).

    Returns:
        ``(images, labels)``: float32 tensor of shape (N, 784) with values in [0, 1] (grey / 255)
            and int64 labels of shape (N,).

    Example (with a tiny IDX file pair written on the spot):
        >>> import os, tempfile
        >>> import numpy as np
        >>> from storch.datasets import load_mnist, write_idx
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_idx(os.path.join(d, "t10k-images-idx3-ubyte.gz"), np.full((3, 28, 28), 255, np.uint8))
        ...     write_idx(os.path.join(d, "t10k-labels-idx1-ubyte.gz"), np.array([7, 2, 1], np.uint8))
        ...     x, y = load_mnist(d, split="test")
        >>> x.shape, x.max().item(), y.tolist()
        (torch.Size([3, 784]), 1.0, [7, 2, 1])
    """
    _check_split(split, ("train", "test"), "load_mnist")
    directory = _check_directory(directory, "load_mnist", _MNIST_HINT)
    prefix = "train" if split == "train" else "t10k"
    image_names = _idx_names(f"{prefix}-images-idx3-ubyte")
    label_names = _idx_names(f"{prefix}-labels-idx1-ubyte")
    image_file = _find(directory, image_names)
    label_file = _find(directory, label_names)

    if image_file is not None or label_file is not None:
        if image_file is None or label_file is None:
            missing = image_names if image_file is None else label_names
            found = label_file if image_file is None else image_file
            raise FileNotFoundError(
                f"load_mnist: found {found.name} in {str(directory)!r} but not its partner "
                f"(looked for {', '.join(missing)}). {_MNIST_HINT}"
            )
        images = read_idx(image_file)
        labels = read_idx(label_file)
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(f"load_mnist: expected images (N, rows, cols) and labels (N,), got "
                             f"{images.shape} in {image_file} and {labels.shape} in {label_file}")
        images = images.reshape(images.shape[0], -1)
    else:
        npz = directory / "mnist_uint8.npz"
        if not npz.is_file():
            raise FileNotFoundError(
                f"load_mnist: no MNIST {split!r} split in {str(directory)!r}; looked for "
                f"{image_names[0]}[.gz] with {label_names[0]}[.gz], and mnist_uint8.npz. {_MNIST_HINT}"
            )
        with np.load(npz) as d:
            images = d[f"x_{split}"]
            labels = d[f"y_{split}"]
        images = images.reshape(images.shape[0], -1)

    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"load_mnist: {images.shape[0]} images but {labels.shape[0]} labels "
                         f"for split {split!r} in {str(directory)!r}")
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
    y = torch.from_numpy(np.ascontiguousarray(labels)).to(torch.int64)
    return x, y


def _read_amat(path: Path) -> np.ndarray:
    # Whitespace-separated 0/1 text, one image (784 values) per line.
    text = path.read_text()
    n_rows = sum(1 for line in text.splitlines() if line.strip())
    values = np.array(text.split(), dtype=np.float32)
    if n_rows == 0 or values.size != n_rows * 784:
        raise ValueError(f"{path}: expected lines of 784 values, got {values.size} values "
                         f"on {n_rows} lines")
    if not np.isin(values, (0.0, 1.0)).all():
        raise ValueError(f"{path}: a binarized .amat file holds only 0 and 1")
    return values.reshape(n_rows, 784).astype(np.uint8)


def load_binarized_mnist(
    directory: PathLike, split: str = "train"
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The statically binarized MNIST of Larochelle & Murray (2011), the standard VAE benchmark.

    Looks in ``directory`` for ``binarized_mnist_packed.npz`` (arrays ``train``, ``valid``,
    ``test``, each row ``np.packbits`` of the 784 pixels) and otherwise for the original text file
    ``binarized_mnist_{split}.amat``. Labels are not part of the original data; when
    ``binarized_mnist_labels.npz`` (arrays ``{split}_labels``) is present they are returned too.

    **The test split is sorted by digit**: its first 980 images are zeros, the next 1135 ones, and
    so on (the train and valid splits are shuffled). Its first 1000 images are therefore nearly all
    one digit, and a bound measured on a prefix is no estimate for the test set. Evaluate on the
    whole split, or on a random subset: `random_subset(x, 1000, torch.Generator().manual_seed(0))`.

    Args:
        directory: the folder holding the files.
        split: ``"train"`` (50000 images), ``"valid"`` (10000) or ``"test"`` (10000).

    Returns:
        ``(images, labels)``: float32 tensor of 0/1 of shape (N, 784), and int64 labels of shape
            (N,) or ``None`` when no labels file is present.

    Example (with a tiny packed file written on the spot):
        >>> import os, tempfile
        >>> import numpy as np
        >>> from storch.datasets import load_binarized_mnist
        >>> pixels = np.zeros((2, 784), np.uint8)
        >>> pixels[1, :10] = 1
        >>> packed = np.packbits(pixels, axis=1)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     np.savez(os.path.join(d, "binarized_mnist_packed.npz"), train=packed, valid=packed, test=packed)
        ...     x, y = load_binarized_mnist(d, split="valid")
        >>> x.shape, x.sum(dim=1).tolist(), y
        (torch.Size([2, 784]), [0.0, 10.0], None)
    """
    _check_split(split, ("train", "valid", "test"), "load_binarized_mnist")
    directory = _check_directory(directory, "load_binarized_mnist", _BINARIZED_HINT)
    packed_file = directory / "binarized_mnist_packed.npz"
    amat_file = directory / f"binarized_mnist_{split}.amat"
    if packed_file.is_file():
        with np.load(packed_file) as d:
            packed = d[split]
        pixels = np.unpackbits(packed, axis=1, count=784)
    elif amat_file.is_file():
        pixels = _read_amat(amat_file)
    else:
        raise FileNotFoundError(
            f"load_binarized_mnist: no {split!r} split in {str(directory)!r}; looked for "
            f"{packed_file.name} and {amat_file.name}. {_BINARIZED_HINT}"
        )
    if pixels.ndim != 2 or pixels.shape[1] != 784:
        raise ValueError(f"load_binarized_mnist: expected rows of 784 pixels, got shape {pixels.shape}")
    x = torch.from_numpy(np.ascontiguousarray(pixels)).to(torch.float32)

    labels = None
    label_file = directory / "binarized_mnist_labels.npz"
    if label_file.is_file():
        with np.load(label_file) as d:
            key = f"{split}_labels"
            if key in d.files:
                labels = torch.from_numpy(np.ascontiguousarray(d[key])).to(torch.int64)
        if labels is not None and labels.shape[0] != x.shape[0]:
            raise ValueError(f"load_binarized_mnist: {x.shape[0]} images but {labels.shape[0]} "
                             f"labels for split {split!r} in {label_file}")
    return x, labels


def load_omniglot(
    directory: PathLike, split: str = "train"
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The 28x28 Omniglot of the IWAE paper (Burda et al. 2016) from ``chardata.mat``.

    The file holds grey values in [0, 1] as columns (``data``: 784 x 24345 for training,
    ``testdata``: 784 x 8070) stored column-major, so each image is transposed back, as the IWAE
    code does (``reshape((-1, 28, 28)).reshape((-1, 784), order="F")``). The alphabet of each image
    (one-hot rows ``target`` / ``testtarget``) is returned as a label when present. Binarize with
    `storch.datasets.dynamic_binarize` per minibatch, as is customary. Reading ``.mat`` needs scipy.

    Args:
        directory: the folder holding ``chardata.mat``.
        split: ``"train"`` or ``"test"``.

    Returns:
        ``(images, alphabet)``: float32 tensor of shape (N, 784) in [0, 1] and int64 alphabet
            indices of shape (N,) (or ``None`` when the file has no targets).

    Example (with a tiny file written on the spot):
        >>> import os, tempfile
        >>> import numpy as np
        >>> from scipy.io import savemat
        >>> from storch.datasets import load_omniglot
        >>> data = np.zeros((784, 2))
        >>> data[1, 0] = 1.0   # image 0, pixel 1 in MATLAB's column-major order: row 1, column 0
        >>> target = np.eye(50)[:, [3, 7]]
        >>> with tempfile.TemporaryDirectory() as d:
        ...     savemat(os.path.join(d, "chardata.mat"), {"data": data, "target": target,
        ...                                             "testdata": data, "testtarget": target})
        ...     x, alphabet = load_omniglot(d, "test")
        >>> x.shape, x.view(2, 28, 28)[0, 1, 0].item(), alphabet.tolist()
        (torch.Size([2, 784]), 1.0, [3, 7])
    """
    _check_split(split, ("train", "test"), "load_omniglot")
    directory = _check_directory(directory, "load_omniglot", _OMNIGLOT_HINT)
    path = directory / "chardata.mat"
    if not path.is_file():
        raise FileNotFoundError(f"load_omniglot: looked for {path.name} in {str(directory)!r}. "
                                f"{_OMNIGLOT_HINT}")
    try:
        from scipy.io import loadmat
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("load_omniglot needs scipy to read chardata.mat: pip install scipy") from e
    mat = loadmat(str(path))
    data_key, target_key = ("data", "target") if split == "train" else ("testdata", "testtarget")
    columns = np.asarray(mat[data_key], dtype=np.float32)
    if columns.ndim != 2 or columns.shape[0] != 784:
        raise ValueError(f"load_omniglot: expected {data_key!r} of shape (784, N), got {columns.shape}")
    images = columns.T.reshape(-1, 28, 28).transpose(0, 2, 1).reshape(-1, 784)
    x = torch.from_numpy(np.ascontiguousarray(images))
    labels = None
    if target_key in mat:
        labels = torch.from_numpy(np.argmax(np.asarray(mat[target_key]), axis=0)).to(torch.int64)
    return x, labels


def dynamic_binarize(
    images: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Dynamic binarization: independent Bernoulli(pixel) draws, to be redrawn for each minibatch.

    Examples:
        >>> import torch
        >>> from storch.datasets import dynamic_binarize
        >>> g = torch.Generator().manual_seed(0)
        >>> dynamic_binarize(torch.tensor([[0.0, 1.0, 1.0]]), generator=g)
        tensor([[0., 1., 1.]])
    """
    return torch.bernoulli(images, generator=generator)


def random_subset(
    data: torch.Tensor | Sequence[torch.Tensor],
    size: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``size`` rows of ``data`` drawn at random without replacement (all rows when ``size`` >= N).

    Use it to evaluate on part of a split: a prefix can be far from representative (the binarized
    MNIST test split is sorted by digit, see `load_binarized_mnist`). Pass a seeded ``generator``
    for the same subset in every run. The rows are ``torch.randperm(N, generator=generator)[:size]``,
    in that order.

    Args:
        data: a tensor, or a tuple/list of tensors with one first dimension N (images and labels),
            subset alike.
        size: the number of rows, a positive integer.
        generator: the random stream of the permutation; the global one if ``None``.

    Returns:
        A tensor or a tuple of tensors, like ``data``, with ``min(size, N)`` rows.

    Examples:
        >>> import torch
        >>> from storch.datasets import random_subset
        >>> x, y = torch.arange(10.0), torch.arange(10)
        >>> xs, ys = random_subset((x, y), 4, torch.Generator().manual_seed(0))
        >>> xs.shape, torch.equal(xs.long(), ys), len(set(ys.tolist()))
        (torch.Size([4]), True, 4)
        >>> torch.equal(random_subset(x, 4, torch.Generator().manual_seed(0)), xs)  # seeded: same rows
        True
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"random_subset: size must be a positive integer, got {size!r}")
    tensors = _same_length(data, "random_subset")
    n = tensors[0].shape[0]
    if size < n:
        device = generator.device if generator is not None else "cpu"
        order = torch.randperm(n, generator=generator, device=device)[:size]
        tensors = tuple(t[order.to(t.device)] for t in tensors)
    return tensors[0] if isinstance(data, torch.Tensor) else tensors


def _same_length(data: torch.Tensor | Sequence[torch.Tensor], what: str) -> tuple[torch.Tensor, ...]:
    """``data`` as a tuple of tensors, checked to share their first dimension."""
    tensors = (data,) if isinstance(data, torch.Tensor) else tuple(data)
    if not tensors:
        raise ValueError(f"{what}: no tensors given")
    n = tensors[0].shape[0]
    for t in tensors[1:]:
        if t.shape[0] != n:
            raise ValueError(f"{what}: tensors differ in their first dimension "
                             f"({[t.shape[0] for t in tensors]})")
    return tensors


def minibatches(
    data: Union[torch.Tensor, Sequence[torch.Tensor]],
    batch_size: int,
    shuffle: bool = True,
    generator: Optional[torch.Generator] = None,
    drop_last: bool = False,
) -> Iterator[Union[torch.Tensor, Tuple[torch.Tensor, ...]]]:
    """Iterate once over ``data`` in minibatches along the first dimension.

    ``data`` is a tensor or a tuple/list of tensors with the same first dimension (images and
    labels, say); each step yields a tensor or a tuple of tensors accordingly. With
    ``shuffle=True`` the order is a fresh random permutation drawn from ``generator``.
    The last, smaller batch is kept unless ``drop_last=True``.

    Examples:
        >>> import torch
        >>> from storch.datasets import minibatches
        >>> x, y = torch.arange(10.0), torch.arange(10)
        >>> [b.tolist() for b in minibatches(x, 4, shuffle=False)]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
        >>> g = torch.Generator().manual_seed(0)
        >>> for xb, yb in minibatches((x, y), 5, generator=g):
        ...     assert xb.shape == (5,) and torch.equal(xb.long(), yb)
    """
    if batch_size < 1:
        raise ValueError(f"minibatches: batch_size must be a positive integer, got {batch_size}")
    single = isinstance(data, torch.Tensor)
    tensors = _same_length(data, "minibatches")
    n = tensors[0].shape[0]
    if shuffle:
        device = generator.device if generator is not None else "cpu"
        order = torch.randperm(n, generator=generator, device=device)
    else:
        order = None
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        end = min(start + batch_size, n)
        if order is None:
            batch = tuple(t[start:end] for t in tensors)
        else:
            idx = order[start:end]
            batch = tuple(t[idx.to(t.device)] for t in tensors)
        yield batch[0] if single else batch
