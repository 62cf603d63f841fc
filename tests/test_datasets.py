"""Tests of storch.datasets: the IDX format, the MNIST/Omniglot loaders, digits, minibatches.

Synthetic files in tmp_path check the formats; one test reads the real data in ../shared/data.
"""

import ast
import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from storch import datasets as D

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# --------------------------------------------------------------------------------------------
# IDX format
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, dtype, gz):
    rng = np.random.default_rng(0)
    array = (rng.normal(size=(4, 3, 5)) * 50).astype(dtype)
    path = tmp_path / ("a-idx3" + (".gz" if gz else ""))
    D.write_idx(path, array)
    back = D.read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    if gz:
        assert path.read_bytes()[:2] == b"\x1f\x8b"


def test_idx_header_layout(tmp_path):
    # The MNIST label-file header: magic 0x00000801, then the count, big-endian.
    path = tmp_path / "labels-idx1-ubyte"
    D.write_idx(path, np.array([5, 0, 4], np.uint8))
    assert path.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 3, 5, 0, 4])
    # A big-endian int32 payload written by hand reads back in native order.
    raw = bytes([0, 0, 0x0C, 1, 0, 0, 0, 2]) + np.array([1, -2], ">i4").tobytes()
    (tmp_path / "ints").write_bytes(raw)
    assert D.read_idx(tmp_path / "ints").tolist() == [1, -2]


def test_idx_gzip_detected_by_content(tmp_path):
    plain = tmp_path / "plain"
    D.write_idx(plain, np.arange(12, dtype=np.uint8).reshape(3, 4))
    disguised = tmp_path / "compressed-without-suffix"
    disguised.write_bytes(gzip.compress(plain.read_bytes()))
    np.testing.assert_array_equal(D.read_idx(disguised), D.read_idx(plain))


def test_idx_rejects_bad_files(tmp_path):
    bad_magic = tmp_path / "bad"
    bad_magic.write_bytes(b"\x01\x00\x08\x01\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="magic"):
        D.read_idx(bad_magic)
    truncated = tmp_path / "short"
    truncated.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(ValueError, match="shape"):
        D.read_idx(truncated)
    with pytest.raises(ValueError, match="dtype"):
        D.write_idx(tmp_path / "x", np.zeros(2, np.complex64))


# --------------------------------------------------------------------------------------------
# MNIST (grey)
# --------------------------------------------------------------------------------------------


def _fake_mnist(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.uint8)


@pytest.mark.parametrize(
    "image_name, label_name",
    [
        ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
        ("train-images.idx3-ubyte", "train-labels.idx1-ubyte"),
    ],
)
def test_load_mnist_idx(tmp_path, image_name, label_name):
    images, labels = _fake_mnist(7)
    D.write_idx(tmp_path / image_name, images)
    D.write_idx(tmp_path / label_name, labels)
    x, y = D.load_mnist(tmp_path, "train")
    assert x.shape == (7, 784) and x.dtype == torch.float32
    assert y.shape == (7,) and y.dtype == torch.int64
    torch.testing.assert_close(x, torch.from_numpy(images.reshape(7, 784)).float() / 255)
    assert y.tolist() == labels.tolist()
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        D.load_mnist(tmp_path, "test")  # only the train split is there


def test_load_mnist_npz(tmp_path):
    xtr, ytr = _fake_mnist(5, seed=1)
    xte, yte = _fake_mnist(3, seed=2)
    np.savez(tmp_path / "mnist_uint8.npz", x_train=xtr.reshape(5, 784), y_train=ytr,
             x_test=xte.reshape(3, 784), y_test=yte)
    x, y = D.load_mnist(str(tmp_path), split="test")
    assert x.shape == (3, 784)
    torch.testing.assert_close(x, torch.from_numpy(xte.reshape(3, 784)).float() / 255)
    assert y.tolist() == yte.tolist()
    assert D.load_mnist(tmp_path)[0].shape == (5, 784)


def test_load_mnist_prefers_idx_over_npz(tmp_path):
    images, labels = _fake_mnist(4)
    D.write_idx(tmp_path / "t10k-images-idx3-ubyte", images)
    D.write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels)
    np.savez(tmp_path / "mnist_uint8.npz", x_test=np.zeros((2, 784), np.uint8), y_test=np.zeros(2, np.uint8))
    assert D.load_mnist(tmp_path, "test")[0].shape == (4, 784)


def test_load_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        D.load_mnist(tmp_path, "train")
    message = str(info.value)
    for part in (str(tmp_path), "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "mnist_uint8.npz", "never downloads"):
        assert part in message
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        D.load_mnist(missing)
    # Images without labels: the message names the missing partner.
    D.write_idx(tmp_path / "train-images-idx3-ubyte", _fake_mnist(2)[0])
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        D.load_mnist(tmp_path)
    # Mismatched counts.
    D.write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="2 images but 3 labels"):
        D.load_mnist(tmp_path)
    with pytest.raises(ValueError, match="split"):
        D.load_mnist(tmp_path, "valid")


# --------------------------------------------------------------------------------------------
# binarized MNIST
# --------------------------------------------------------------------------------------------


def _fake_binarized(tmp_path, sizes=(6, 3, 4), labels=True):
    rng = np.random.default_rng(3)
    pixels = {s: rng.integers(0, 2, size=(n, 784), dtype=np.uint8)
              for s, n in zip(("train", "valid", "test"), sizes)}
    np.savez(tmp_path / "binarized_mnist_packed.npz",
             **{s: np.packbits(p, axis=1) for s, p in pixels.items()})
    lab = {s: rng.integers(0, 10, len(p)).astype(np.uint8) for s, p in pixels.items()}
    if labels:
        np.savez(tmp_path / "binarized_mnist_labels.npz", **{f"{s}_labels": v for s, v in lab.items()})
    return pixels, lab


def test_load_binarized_mnist_packed(tmp_path):
    pixels, lab = _fake_binarized(tmp_path)
    for split in ("train", "valid", "test"):
        x, y = D.load_binarized_mnist(tmp_path, split)
        assert x.dtype == torch.float32 and x.shape == (len(pixels[split]), 784)
        np.testing.assert_array_equal(x.numpy(), pixels[split])
        assert y.dtype == torch.int64 and y.tolist() == lab[split].tolist()


def test_load_binarized_mnist_without_labels(tmp_path):
    pixels, _ = _fake_binarized(tmp_path, labels=False)
    x, y = D.load_binarized_mnist(tmp_path, "valid")
    assert y is None
    np.testing.assert_array_equal(x.numpy(), pixels["valid"])


def test_load_binarized_mnist_amat(tmp_path):
    rng = np.random.default_rng(4)
    pixels = rng.integers(0, 2, size=(5, 784), dtype=np.uint8)
    text = "\n".join(" ".join(str(v) for v in row) for row in pixels) + "\n"
    (tmp_path / "binarized_mnist_test.amat").write_text(text)
    x, y = D.load_binarized_mnist(tmp_path, "test")
    assert y is None
    np.testing.assert_array_equal(x.numpy(), pixels)
    (tmp_path / "binarized_mnist_valid.amat").write_text("0 1 1\n")
    with pytest.raises(ValueError, match="784"):
        D.load_binarized_mnist(tmp_path, "valid")


def test_load_binarized_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        D.load_binarized_mnist(tmp_path, "valid")
    message = str(info.value)
    for part in (str(tmp_path), "binarized_mnist_packed.npz", "binarized_mnist_valid.amat"):
        assert part in message
    with pytest.raises(ValueError, match="split"):
        D.load_binarized_mnist(tmp_path, "validation")


# --------------------------------------------------------------------------------------------
# Omniglot
# --------------------------------------------------------------------------------------------


def test_load_omniglot_matches_iwae_layout(tmp_path):
    from scipy.io import savemat
    rng = np.random.default_rng(5)
    train, test = rng.random((784, 6)), rng.random((784, 2))
    target = np.eye(50)[:, rng.integers(0, 50, 6)]
    savemat(tmp_path / "chardata.mat", {"data": train, "testdata": test, "target": target})

    def iwae(data):  # the IWAE repository's reshape_data on data.T
        return data.T.reshape((-1, 28, 28)).reshape((-1, 28 * 28), order="F")

    x, alphabet = D.load_omniglot(tmp_path)
    assert x.dtype == torch.float32 and x.shape == (6, 784)
    np.testing.assert_allclose(x.numpy(), iwae(train).astype(np.float32))
    assert alphabet.tolist() == np.argmax(target, axis=0).tolist()
    x, alphabet = D.load_omniglot(tmp_path, "test")
    np.testing.assert_allclose(x.numpy(), iwae(test).astype(np.float32))
    assert alphabet is None  # no "testtarget" in this file
    with pytest.raises(FileNotFoundError, match="chardata.mat"):
        D.load_omniglot(tmp_path / "nowhere")


# --------------------------------------------------------------------------------------------
# digits, binarization, minibatches
# --------------------------------------------------------------------------------------------


def test_load_digits_binarized():
    x, y = D.load_digits_binarized()
    assert x.shape == (1797, 64) and x.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert set(x.unique().tolist()) == {0.0, 1.0}
    assert set(y.tolist()) == set(range(10))
    assert 0.2 < x.mean().item() < 0.6
    from sklearn.datasets import load_digits

    digits = load_digits()
    assert torch.equal(x, (torch.from_numpy(digits.data) >= 8).float())
    assert torch.equal(y, torch.from_numpy(digits.target).long())
    assert D.load_digits_binarized(threshold=1.0)[0].mean() > x.mean()


def test_load_digits_binarized_needs_no_scikit_learn(monkeypatch):
    # the digits ship inside the package: a core install (no extras) loads them
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn` raises ImportError
    x, y = D.load_digits_binarized()
    assert x.shape == (1797, 64) and y.shape == (1797,)


def test_dynamic_binarize():
    probs = torch.rand(200, 784, generator=torch.Generator().manual_seed(0))
    b = D.dynamic_binarize(probs, generator=torch.Generator().manual_seed(1))
    assert b.shape == probs.shape and set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.mean().item() - probs.mean().item()) < 0.01
    b2 = D.dynamic_binarize(probs, generator=torch.Generator().manual_seed(1))
    assert torch.equal(b, b2)


def test_minibatches():
    x = torch.arange(23.0).unsqueeze(1)
    y = torch.arange(23)
    batches = list(D.minibatches((x, y), 5, generator=torch.Generator().manual_seed(0)))
    assert [len(b[0]) for b in batches] == [5, 5, 5, 5, 3]
    seen = torch.cat([b[1] for b in batches])
    assert sorted(seen.tolist()) == list(range(23)) and seen.tolist() != list(range(23))
    for xb, yb in batches:
        assert torch.equal(xb.squeeze(1).long(), yb)
    again = list(D.minibatches((x, y), 5, generator=torch.Generator().manual_seed(0)))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    in_order = list(D.minibatches(y, 10, shuffle=False, drop_last=True))
    assert [b.tolist() for b in in_order] == [list(range(10)), list(range(10, 20))]
    assert isinstance(in_order[0], torch.Tensor)
    with pytest.raises(ValueError, match="first dimension"):
        next(D.minibatches((x, y[:5]), 2))
    with pytest.raises(ValueError, match="batch_size"):
        next(D.minibatches(x, 0))


def test_random_subset():
    x = torch.arange(23.0).unsqueeze(1)
    y = torch.arange(23)
    xs, ys = D.random_subset((x, y), 7, torch.Generator().manual_seed(0))
    assert xs.shape == (7, 1) and ys.shape == (7,) and torch.equal(xs.squeeze(1).long(), ys)
    assert len(set(ys.tolist())) == 7 and ys.tolist() != list(range(7))  # no repeats, not a prefix
    again = D.random_subset(y, 7, torch.Generator().manual_seed(0))
    assert torch.equal(again, ys)  # seeded: the same rows, also for a single tensor
    # the rows of randperm(N)[:size]: storch-bench's eval_subset(x, size, seed) draws the same subset
    assert torch.equal(ys, torch.randperm(23, generator=torch.Generator().manual_seed(0))[:7])
    assert D.random_subset(y, 23) is y and D.random_subset(y, 100) is y
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="random_subset: size must be a positive integer"):
            D.random_subset(y, bad)
    with pytest.raises(ValueError, match="random_subset: tensors differ in their first dimension"):
        D.random_subset((x, y[:5]), 2)


def test_datasets_module_is_standalone():
    """storch.datasets imports only the standard library, numpy and torch at module level."""
    tree = ast.parse(Path(D.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports in storch.datasets"
            top.add(node.module.split(".")[0])
    assert top <= {"__future__", "gzip", "importlib", "os", "pathlib", "typing", "numpy", "torch"}, top


# --------------------------------------------------------------------------------------------
# the real data in ../shared/data
# --------------------------------------------------------------------------------------------


def test_real_data():
    if not SHARED_DATA.is_dir():
        pytest.fail(f"the benchmark data directory {SHARED_DATA} is missing: this repository "
                    "expects ../shared/data beside it (see SPEC.md section 7)")
    x, y = D.load_binarized_mnist(SHARED_DATA, "train")
    assert x.shape == (50000, 784) and y.shape == (50000,)
    assert bool(((x == 0) | (x == 1)).all()) and set(y.unique().tolist()) == set(range(10))
    assert 0.1 < x.mean().item() < 0.2  # about 13% of binarized MNIST pixels are on

    xv, yv = D.load_binarized_mnist(SHARED_DATA, "valid")
    xt, yt = D.load_binarized_mnist(SHARED_DATA, "test")
    assert xv.shape == xt.shape == (10000, 784) and yv.shape == yt.shape == (10000,)

    # Grey MNIST test split (reads only x_test/y_test of mnist_uint8.npz).
    mx, my = D.load_mnist(SHARED_DATA, "test")
    assert mx.shape == (10000, 784) and my.shape == (10000,)
    assert mx.min().item() == 0.0 and mx.max().item() == 1.0
    # The binarized test labels point at the MNIST test images they came from.
    with np.load(SHARED_DATA / "binarized_mnist_labels.npz") as d:
        src = torch.from_numpy(d["test_src_idx"]).long()
    assert torch.equal(yt, my[src])
    agreement = ((mx[src] > 0.5).float() == xt).float().mean().item()
    assert agreement > 0.9


def test_binarized_test_split_is_sorted_by_digit_and_the_loader_says_so():
    """Its first 1000 images are nearly all zeros: evaluate on a random subset, never a prefix."""
    if not SHARED_DATA.is_dir():
        pytest.fail(f"the benchmark data directory {SHARED_DATA} is missing")
    _, y = D.load_binarized_mnist(SHARED_DATA, "test")
    assert torch.bincount(y[:1000], minlength=10)[0] >= 950
    assert bool((y[1:] >= y[:-1]).all())
    _, ys = D.random_subset((y, y), 1000, torch.Generator().manual_seed(0))
    assert torch.bincount(ys, minlength=10).min() >= 60  # every digit, about 100 each
    doc = " ".join(D.load_binarized_mnist.__doc__.split())
    assert "test split is sorted by digit" in doc and "random_subset" in doc
