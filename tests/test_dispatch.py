"""Plate alignment and op dispatch (``storch._dispatch``), and that importing storch patches nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical, kl_divergence

import storch
from storch.method import Reparameterization, ScoreFunction
from storch.tensor import plain


def _node(name, n, shape=(2,), method=ScoreFunction):
    return method(name, n_samples=n)(Normal(torch.zeros(shape), 1.0))


def raw(t, *names):
    """The values of ``t`` with its plates permuted into the order ``names``.

    Stochastic plates are laid out newest first; an independent plate (denote_independent) is shared
    with any live plate of the same name and size, so its position relative to node plates depends on
    object lifetimes. Tests compare values in a fixed order instead.
    """
    assert sorted(t.plate_names) == sorted(names), (t.plate_names, names)
    perm = [t.plate_names.index(n) for n in names]
    return t._tensor.permute(*perm, *range(len(perm), t.dim()))


# ---------------------------------------------------------------------------- fast path


def test_same_plates_fast_path_keeps_layout_and_values():
    z = _node("z", 3)
    y = z * 2 + z
    assert type(y) is storch.Tensor
    assert y._layout is z._layout  # shared layout object: no realignment
    torch.testing.assert_close(y._tensor, 3 * z._tensor)
    w = torch.sin(y).exp()
    assert w._layout is z._layout and w.shape == (3, 2)


def test_metadata_queries_read_plain_values():
    """Shape queries bypass the dispatch (read in C) and answer as for a plain tensor; getters and
    methods that torch hands over with an empty keyword dict work too."""
    plain = torch.zeros(3, 2, dtype=torch.float64)
    x = storch.denote_independent(plain, 0, "data")
    assert (x.shape, x.size(), x.size(-1), x.size(dim=0), x.dim(), x.ndim) == (
        plain.shape, plain.size(), 2, 3, 2, 2
    )
    assert (x.dtype, x.device) == (torch.float64, plain.device)
    assert type(x.shape) is torch.Size
    grad_getter = torch.Tensor.grad.__get__
    assert torch.overrides.handle_torch_function(grad_getter, (x,), x) is None  # kwargs={}
    assert torch.overrides.handle_torch_function(torch.Tensor.size, (x,), x, dim=1) == 2
    with pytest.raises(IndexError):
        x.size(5)


def test_methods_that_return_tensors_keep_plates():
    z = _node("z", 3)
    for out in (z.detach(), z.double(), z.to(torch.float64), z.clone(), z.unsqueeze(-1), z.sum(-1)):
        assert isinstance(out, storch.Tensor)
        assert out.plate_names == ["z"]
    assert z.double().dtype == torch.float64
    assert z.unsqueeze(-1).shape == (3, 2, 1)


def test_inplace_op_keeps_layout():
    z = _node("z", 3)
    y = z * 1
    out = y.add_(1.0)
    assert out is y
    assert y.plate_names == ["z"]
    torch.testing.assert_close(y._tensor, z._tensor + 1)


def test_gradients_flow_through_dispatch():
    mu = torch.tensor([1.0, 2.0], requires_grad=True)
    z = Reparameterization("z", n_samples=3)(Normal(mu, 1.0))
    loss = storch.sum((z * 2).sum(-1), "z")
    loss.backward()
    torch.testing.assert_close(mu.grad, torch.tensor([6.0, 6.0]))


# --------------------------------------------------------------------- different plates


def test_two_independent_nodes_broadcast_into_joint_layout():
    z1 = _node("z1", 3)
    z2 = _node("z2", 4)
    s = z1 + z2
    assert s.plate_names == ["z2", "z1"]  # newest plate leftmost
    assert s.shape == (4, 3, 2)
    expected = z2._tensor[:, None, :] + z1._tensor[None, :, :]
    torch.testing.assert_close(s._tensor, expected)
    # the order of the arguments does not matter
    s2 = z2 * 1 + z1
    assert s2.plate_names == ["z2", "z1"]
    torch.testing.assert_close(s2._tensor, expected)


def test_union_of_partially_overlapping_layouts():
    z1 = _node("z1", 3)
    z2 = _node("z2", 4)
    z3 = _node("z3", 5)
    a = z1 + z2  # [z2, z1]
    b = z1 * z3  # [z3, z1]
    c = a + b
    assert c.plate_names == ["z3", "z2", "z1"]
    assert c.shape == (5, 4, 3, 2)
    expected = (
        z2._tensor[None, :, None] + z1._tensor[None, None, :] + z1._tensor[None, None, :] * z3._tensor[:, None, None]
    )
    torch.testing.assert_close(c._tensor, expected)


def test_nested_node_gets_its_own_plate_on_top():
    z1 = _node("z1", 3)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    loc = x + z1
    z2 = Reparameterization("z2", n_samples=5)(Normal(loc, 1.0))
    assert z2.plate_names[0] == "z2"  # the new node's plate is on top of its parents' plates
    assert z2.plate_names[1:] == loc.plate_names
    assert z2.shape == (5, 6, 3, 2) or z2.shape == (5, 3, 6, 2)
    assert set(p.name for p in z2.plate.parents) == {"data", "z1"}
    # combining with the parents needs no extra plates
    y = z2 - loc
    assert y.plate_names == z2.plate_names
    torch.testing.assert_close(y._tensor, z2._tensor - loc._tensor[None])


def test_plain_tensors_broadcast_against_event_dims():
    z = _node("z", 3, shape=(4, 2))
    v = torch.tensor([10.0, 20.0])
    y = z + v
    assert y.plate_names == ["z"] and y.shape == (3, 4, 2)
    torch.testing.assert_close(y._tensor, z._tensor + v)
    col = torch.arange(4.0).reshape(4, 1)
    torch.testing.assert_close((z * col)._tensor, z._tensor * col)
    assert (z + 1.0).shape == (3, 4, 2)
    assert (z + torch.tensor(1.0)).shape == (3, 4, 2)
    # storch tensors without plates behave like plain ones
    u = storch.Tensor(torch.tensor([1.0, 2.0]))
    assert (z + u).shape == (3, 4, 2)


def test_plain_tensor_with_more_dims_than_the_event_broadcasts_per_sample():
    # Code written for one sample: a scalar sample times a matrix is a matrix per sample. The plain
    # tensor must not broadcast into the plate dimension (with n == 5 that would silently pair
    # sample i with column i and still label dimension 0 as plate 'z').
    z = _node("z", 5, shape=())
    eye = torch.eye(5)
    y = z * eye
    assert y.plate_names == ["z"]
    assert y.shape == (5, 5, 5), (
        f"plain (5, 5) tensor broadcast into the plate dimension of a (5,)-sample tensor: got shape "
        f"{tuple(y.shape)}"
    )
    torch.testing.assert_close(y._tensor, z._tensor[:, None, None] * eye)
    w = _node("w", 3, shape=(4, 2))
    y3 = w + torch.zeros(5, 1, 1)
    assert y3.plate_names == ["w"] and y3.shape == (3, 5, 4, 2)


def test_event_dim_padding_between_plated_tensors():
    z = _node("z", 3)  # event (2,)
    w = storch.denote_independent(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), 0, "data")  # event ()
    y = w + z
    expected = w._tensor[:, None, None] + z._tensor[None, :, :]
    torch.testing.assert_close(raw(y, "data", "z"), expected)
    assert y.event_shape == (2,)
    # event (4,) against event (2, 4): right-aligned as for single samples
    a = storch.denote_independent(torch.randn(5, 4), 0, "data")
    b = _node("b", 3, shape=(2, 4))
    c = a * b
    assert c.event_shape == (2, 4)
    torch.testing.assert_close(raw(c, "b", "data"), a._tensor[None, :, None, :] * b._tensor[:, None])


def test_minibatch_plate_combines_with_samples():
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    z = _node("z", 3)  # sampled after the minibatch was denoted: the newest plate
    y = x * z
    assert y.plate_names == ["z", "data"]
    assert y.shape == (3, 6, 2)
    torch.testing.assert_close(y._tensor, x._tensor[None] * z._tensor[:, None])
    assert (y + x).plate_names == ["z", "data"]


def test_where_with_plated_condition():
    z = _node("z", 3)
    x = storch.denote_independent(torch.randn(5, 2), 0, "data")
    out = torch.where(z > 0, x, torch.zeros(2))
    torch.testing.assert_close(raw(out, "data", "z"), torch.where(z._tensor[None] > 0, x._tensor[:, None], 0.0))


# ---------------------------------------------------------------------- linear algebra


def test_matmul_with_plated_inputs():
    z = _node("z", 3)
    W = torch.randn(2, 5)
    y = z @ W
    assert y.plate_names == ["z"] and y.shape == (3, 5)
    torch.testing.assert_close(y._tensor, z._tensor @ W)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    y2 = torch.matmul(x + z, W)
    assert y2.event_shape == (5,)
    torch.testing.assert_close(raw(y2, "data", "z"), (x._tensor[:, None] + z._tensor[None]) @ W)


def test_matmul_of_two_differently_plated_matrices():
    A = _node("A", 3, shape=(2, 2))  # (3, 2, 2)
    B = storch.denote_independent(torch.randn(6, 2, 1), 0, "data")  # (6, 2, 1)
    C = A @ B
    assert C.event_shape == (2, 1)
    torch.testing.assert_close(raw(C, "data", "A"), torch.einsum("aij,djk->daik", A._tensor, B._tensor))


def test_linear_with_plated_input():
    z = _node("z", 3)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    W, b = torch.randn(5, 2), torch.randn(5)
    y = F.linear(x * z, W, b)
    assert y.event_shape == (5,)
    torch.testing.assert_close(raw(y, "data", "z"), (x._tensor[:, None] * z._tensor[None]) @ W.T + b)


def test_nn_linear_and_sequential_on_plated_inputs():
    torch.manual_seed(1)
    z = _node("z", 3)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    h = x + z
    lin = torch.nn.Linear(2, 7)
    out = lin(h)
    assert isinstance(out, storch.Tensor)
    assert out.plate_names == h.plate_names and out.event_shape == (7,)
    torch.testing.assert_close(raw(out, "data", "z"), lin(raw(h, "data", "z")))
    seq = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1), torch.nn.Sigmoid())
    out2 = seq(h)
    assert out2.plate_names == h.plate_names and out2.event_shape == (1,)
    torch.testing.assert_close(raw(out2, "data", "z"), seq(raw(h, "data", "z")))
    # the module parameters get gradients through the plated output
    storch.reduce_plates(out2.sum(-1)).backward()
    assert all(p.grad is not None for p in seq.parameters())


def test_module_parameters_stay_plain():
    lin = torch.nn.Linear(2, 3)
    lin(_node("z", 3))
    assert type(lin.weight) is torch.nn.Parameter


# ------------------------------------------------------------------------- cat / stack


def test_cat_and_stack_expand_plates():
    z = _node("z", 3)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    c = torch.cat([z, x], -1)
    assert c.event_shape == (4,)
    torch.testing.assert_close(raw(c, "data", "z")[..., :2], z._tensor[None].expand(6, 3, 2))
    torch.testing.assert_close(raw(c, "data", "z")[..., 2:], x._tensor[:, None].expand(6, 3, 2))
    s = torch.stack([z, x], -1)
    assert s.event_shape == (2, 2)
    torch.testing.assert_close(raw(s, "data", "z")[..., 0], z._tensor[None].expand(6, 3, 2))
    torch.testing.assert_close(raw(s, "data", "z")[..., 1], x._tensor[:, None].expand(6, 3, 2))
    # plain members are expanded over the plates
    c2 = torch.cat([z, torch.ones(1)], -1)
    assert c2.plate_names == ["z"] and c2.shape == (3, 3)
    torch.testing.assert_close(c2._tensor[:, 2], torch.ones(3))
    # same layout
    s2 = torch.stack([z, z * 2], -1)
    assert s2.shape == (3, 2, 2) and s2.plate_names == ["z"]


# ----------------------------------------------------------------------- distributions


def test_normal_from_plated_parameters():
    z = _node("z", 3)
    d = Normal(z, 2.0)
    assert d.batch_shape == (3, 2)
    value = torch.tensor([0.5, -0.5])
    lp = d.log_prob(value)
    assert isinstance(lp, storch.Tensor) and lp.plate_names == ["z"]
    torch.testing.assert_close(lp._tensor, Normal(z._tensor, 2.0).log_prob(value))
    s = d.sample()
    assert s.shape == (3, 2)


def test_bernoulli_categorical_onehot_from_plated_parameters():
    z = _node("z", 3)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    logits = x + z  # plates data and z, event (2,)
    names = logits.plate_names
    values = logits._tensor
    b = Bernoulli(logits=logits)
    lp = b.log_prob(torch.tensor([1.0, 0.0]))
    assert lp.plate_names == names and lp.event_shape == (2,)
    torch.testing.assert_close(lp._tensor, Bernoulli(logits=values).log_prob(torch.tensor([1.0, 0.0])))
    c = Categorical(logits=logits)
    assert c.batch_shape == values.shape[:2]
    lpc = c.log_prob(torch.tensor(1))
    assert lpc.plate_names == names and lpc.event_shape == ()
    torch.testing.assert_close(lpc._tensor, torch.log_softmax(values, -1)[..., 1])
    oh = OneHotCategorical(logits=logits)
    lpo = oh.log_prob(torch.tensor([0.0, 1.0]))
    assert lpo.plate_names == names and lpo.event_shape == ()
    torch.testing.assert_close(lpo._tensor, lpc._tensor)
    torch.testing.assert_close(oh.probs._tensor, torch.softmax(values, -1))


def test_kl_divergence_with_plated_parameters():
    z = _node("z", 3)
    kl = kl_divergence(Normal(z, 1.0), Normal(0.0, 1.0))
    assert kl.plate_names == ["z"] and kl.shape == (3, 2)
    torch.testing.assert_close(kl._tensor, 0.5 * z._tensor ** 2)
    x = storch.denote_independent(torch.randn(6, 2), 0, "data")
    q = OneHotCategorical(logits=x + z)
    prior = OneHotCategorical(probs=torch.ones(2) / 2)
    kl2 = kl_divergence(q, prior)
    assert kl2.event_shape == ()
    p = torch.softmax((x._tensor[:, None] + z._tensor[None]), -1)
    torch.testing.assert_close(raw(kl2, "data", "z"), (p * (p.log() - torch.log(torch.tensor(0.5)))).sum(-1))


def test_boolean_full_reductions_may_drop_plates():
    z = _node("z", 3)
    out = (z > -1e9).all()
    assert type(out) is torch.Tensor and bool(out)
    assert type(torch.any(z > 1e9)) is torch.Tensor


# ------------------------------------------------------------------------------ errors


def _bce_setup():
    x = storch.denote_independent((torch.rand(6, 4) > 0.5).float(), 0, "data")
    logits = torch.zeros(4, requires_grad=True)
    z = ScoreFunction("z", n_samples=3)(Bernoulli(logits=logits))
    recon = torch.sigmoid(z * 2.0 - 1.0 + 0 * x)
    return recon, x


def test_mean_over_plates_raises_naming_the_plates():
    recon, x = _bce_setup()
    bce = torch.nn.BCELoss(reduction="none")(recon, x).sum(-1)
    assert sorted(bce.plate_names) == ["data", "z"] and bce.event_shape == ()
    with pytest.raises(ValueError, match="We expected 2 plate dimensions") as info:
        torch.mean(bce)
    assert "'data'" in str(info.value) and "'z'" in str(info.value)
    assert "reduce_plates" in str(info.value)


def test_bce_loss_reduction_sum_raises():
    recon, x = _bce_setup()
    with pytest.raises(ValueError, match="too few dimensions") as info:
        torch.nn.BCELoss(reduction="sum")(recon, x)
    assert "'data'" in str(info.value)


def test_reducing_or_reshaping_a_plate_dimension_raises():
    z = _node("z", 3)
    for bad in (
        lambda: z.sum(),
        lambda: z.mean(0),
        lambda: z.reshape(-1),
        lambda: z.view(6),
        lambda: z[0],
        lambda: z.transpose(0, 1),
    ):
        with pytest.raises(ValueError, match="plate 'z'"):
            bad()
    # event-dimension operations are fine
    assert z.sum(-1).shape == (3,)
    assert z[..., 0].shape == (3,)
    assert z[:, 1].shape == (3,)


# ---------------------------------------------------------------- no monkey-patching


_RECORD = textwrap.dedent(
    """
    import json, sys, torch
    def snapshot():
        D = torch.distributions.Distribution
        return {
            "validate": repr(D._validate_args),
            "is_tensor": id(torch.is_tensor),
            "to": id(torch.Tensor.to),
            "le": id(torch.Tensor.le),
            "gt": id(torch.Tensor.gt),
            "tf": id(torch.Tensor.__torch_function__.__func__),
            "torch_attrs": sorted(dir(torch)),
            "tensor_attrs": sorted(dir(torch.Tensor)),
            "dtype": repr(torch.get_default_dtype()),
        }
    before = snapshot()
    import storch
    after = snapshot()
    diff = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if "torch_attrs" in diff:
        diff["torch_attrs"] = sorted(set(after["torch_attrs"]) ^ set(before["torch_attrs"]))
    if "tensor_attrs" in diff:
        diff["tensor_attrs"] = sorted(set(after["tensor_attrs"]) ^ set(before["tensor_attrs"]))
    print(json.dumps(diff))
    """
)


def test_importing_storch_changes_nothing_in_torch():
    import json

    out = subprocess.run([sys.executable, "-c", _RECORD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    diff = json.loads(out.stdout.strip().splitlines()[-1])
    assert diff == {}, f"importing storch changed torch: {diff}"


def test_torch_is_tensor_and_validate_args_unchanged_in_process():
    import torch.distributions as D

    assert D.Distribution._validate_args is D.Distribution.__dict__["_validate_args"]
    assert torch.is_tensor.__module__ == "torch"
    assert torch.Tensor.__torch_function__.__func__.__module__ == "torch._tensor"
    assert torch.Tensor.to.__qualname__.startswith("TensorBase")


def test_indexing_that_would_mix_samples_is_refused():
    """`t[index]` counts dimensions plates first; torch's indexing cannot index sample by sample."""
    x = storch.denote_independent(torch.arange(15.0).reshape(5, 3), 0, "data")
    i = storch.denote_independent(torch.tensor([0, 1, 2, 0, 1]), 0, "data")
    with pytest.raises(ValueError, match="plates first"):
        x[torch.tensor([4, 3, 2, 1, 0])]  # a permutation of the data plate, same shape
    with pytest.raises(ValueError, match="mixing the samples"):
        x[i]
    with pytest.raises(ValueError, match="mixing the samples"):
        x[..., i]
    # what works: one sample's dimensions, a plain table indexed by a plated index, gather per sample
    assert x[:, 1].shape == (5,) and x[..., 1:].shape == (5, 2) and x[..., torch.tensor([0, 2])].shape == (5, 2)
    assert torch.equal(plain(torch.gather(x, -1, i.unsqueeze(-1)).squeeze(-1)), torch.tensor([0.0, 4, 8, 9, 13]))
    table = torch.arange(3.0)
    assert torch.equal(plain(table[i]), torch.tensor([0.0, 1, 2, 0, 1]))
