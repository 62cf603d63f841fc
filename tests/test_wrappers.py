"""storch.deterministic, storch.reduce, storch.make_left_broadcastable, storch.stochastic."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal

import storch
from storch.exceptions import IllegalStorchExposeError
from storch.method import Reparameterization, ScoreFunction


def _z(n=3, shape=(2,), name="z"):
    return Reparameterization(name, n_samples=n)(Normal(torch.zeros(shape), 1.0))


def _data(n=5, shape=(2,)):
    return storch.denote_independent(torch.randn(n, *shape), 0, "data")


def raw(t, *names):
    """The values of ``t`` with its plates permuted into the order ``names`` (an independent plate's
    position relative to node plates depends on whether an equal plate object is still alive)."""
    assert sorted(t.plate_names) == sorted(names), (t.plate_names, names)
    perm = [t.plate_names.index(n) for n in names]
    return t._tensor.permute(*perm, *range(len(perm), t.dim()))


class _Spy:
    """A function that records what it was called with."""

    def __init__(self, fn=lambda *a, **k: a[0]):
        self.fn = fn
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


# ------------------------------------------------------------------------ deterministic


def test_deterministic_unwraps_aligns_and_rewraps():
    z1 = _z(name="z1")
    z2 = _z(n=4, name="z2")
    spy = _Spy(lambda a, b: a + b)
    out = storch.deterministic(spy)(z1, z2)
    (a, b), _ = spy.calls[0]
    assert type(a) is torch.Tensor and type(b) is torch.Tensor
    assert a.shape == (1, 3, 2) and b.shape == (4, 1, 2)  # union [z2, z1], size-1 for missing plates
    assert isinstance(out, storch.Tensor)
    assert out.plate_names == ["z2", "z1"] and out.shape == (4, 3, 2)
    torch.testing.assert_close(out._tensor, z2._tensor[:, None] + z1._tensor[None])
    x = _data()
    out2 = storch.deterministic(lambda a, b: a * b)(z1, x)
    torch.testing.assert_close(raw(out2, "data", "z1"), x._tensor[:, None] * z1._tensor[None])


def test_deterministic_as_decorator_with_options():
    z = _z()
    x = _data()

    @storch.deterministic(expand_plates=True)
    def f(a, b):
        assert a.shape == b.shape and a.shape in ((5, 3, 2), (3, 5, 2))
        return a * b

    out = f(z, x)
    torch.testing.assert_close(raw(out, "data", "z"), x._tensor[:, None] * z._tensor[None])


def test_deterministic_flatten_plates():
    z = _z()
    x = _data()
    spy = _Spy(lambda a, b: torch.cat([a, b], -1))
    out = storch.deterministic(spy, flatten_plates=True)(z, x)
    (a, b), _ = spy.calls[0]
    assert a.shape == (15, 2) and b.shape == (15, 2)
    assert out.event_shape == (4,)
    torch.testing.assert_close(raw(out, "data", "z")[..., :2], z._tensor[None].expand(5, 3, 2))
    torch.testing.assert_close(raw(out, "data", "z")[..., 2:], x._tensor[:, None].expand(5, 3, 2))


def test_deterministic_flatten_plates_requires_the_batch_dim_to_survive():
    z = _z()
    with pytest.raises(ValueError, match="flattened"):
        storch.deterministic(lambda a: a.sum(0), flatten_plates=True)(z)


def test_deterministic_unwrap_false_passes_storch_tensors():
    z = _z()
    spy = _Spy()
    storch.deterministic(spy, unwrap=False)(z)
    (a,), _ = spy.calls[0]
    assert isinstance(a, storch.Tensor) and a.plate_names == ["z"]


def test_deterministic_unwraps_even_when_no_alignment_is_needed():
    z = _z()
    spy = _Spy(lambda a: a.tolist())  # .tolist() on a storch tensor with 3 samples would raise
    storch.deterministic(spy)(z)
    (a,), _ = spy.calls[0]
    assert type(a) is torch.Tensor


def test_deterministic_never_retypes_the_callers_tensors():
    z = _z()
    p = torch.ones(2)
    spy = _Spy(lambda a, b: a + b)
    out = storch.deterministic(spy, unwrap=False)(z, p)
    assert type(z) is storch.StochasticTensor and z.plate_names == ["z"]
    assert type(p) is torch.Tensor
    (a, b), _ = spy.calls[0]
    assert a is not z and isinstance(a, storch.Tensor) and a.plate_names == ["z"]
    assert type(b) is torch.Tensor  # a plain input has no plates to carry
    assert out.plate_names == ["z"]
    ident = storch.deterministic(lambda a: a)(z)
    assert ident is not z and type(z) is storch.StochasticTensor


def test_deterministic_plain_inputs_and_nested_containers():
    z = _z()
    spy = _Spy(lambda d, scale: d["a"][0] * scale)
    out = storch.deterministic(spy)({"a": [z]}, scale=torch.tensor(2.0))
    (d,), kwargs = spy.calls[0]
    assert type(d["a"][0]) is torch.Tensor
    assert type(kwargs["scale"]) is torch.Tensor
    torch.testing.assert_close(out._tensor, 2 * z._tensor)
    assert out.plate_names == ["z"]


def test_deterministic_dim_names_a_plate():
    z = _z()
    x = _data()
    h = x + z
    values = raw(h, "data", "z")
    sm = storch.deterministic(torch.softmax, dim="z")(h)
    assert sm.plate_names == h.plate_names
    torch.testing.assert_close(raw(sm, "data", "z"), torch.softmax(values, dim=1))
    sm_data = storch.deterministic(torch.softmax, dim="data")(h)
    torch.testing.assert_close(raw(sm_data, "data", "z"), torch.softmax(values, dim=0))


def test_deterministic_dims_names_plates():
    z = _z()
    x = _data()
    h = x + z
    values = raw(h, "data", "z")
    flipped = storch.deterministic(torch.flip, dims=["z"])(h)
    torch.testing.assert_close(raw(flipped, "data", "z"), torch.flip(values, dims=[1]))
    both = storch.deterministic(torch.flip, dims=["data", "z"])(h)
    torch.testing.assert_close(raw(both, "data", "z"), torch.flip(values, dims=[0, 1]))
    with pytest.raises(ValueError, match="No plate named 'nope'"):
        storch.deterministic(torch.flip, dims=["nope"])(h)


def test_deterministic_output_that_drops_a_plate_raises():
    z = _z()
    with pytest.raises(ValueError, match="plate 'z'"):
        storch.deterministic(lambda a: a.sum(0))(z)


def test_deterministic_gradients_flow():
    mu = torch.tensor([1.0, -1.0], requires_grad=True)
    z = Reparameterization("z", n_samples=4)(Normal(mu, 1.0))
    out = storch.deterministic(lambda a: 3 * a)(z)
    storch.sum(out.sum(-1), "z").backward()
    torch.testing.assert_close(mu.grad, torch.tensor([12.0, 12.0]))


# ------------------------------------------------------------------------------ reduce


def test_reduce_one_plate():
    z = _z()
    x = _data()
    h = x + z
    values = raw(h, "data", "z")
    r = storch.reduce(torch.logsumexp, "z")(h)
    assert r.plate_names == ["data"] and r.shape == (5, 2)
    torch.testing.assert_close(r._tensor, torch.logsumexp(values, dim=1))
    r2 = storch.reduce(torch.sum, "data")(h)
    assert r2.plate_names == ["z"] and r2.shape == (3, 2)
    torch.testing.assert_close(r2._tensor, values.sum(0))


def test_reduce_several_plates():
    z = _z()
    x = _data()
    h = x + z

    def total(t, dims):
        return t.sum(dim=dims)

    r = storch.reduce(total, ["z", "data"])(h)
    assert r.plates == [] and r.shape == (2,)
    torch.testing.assert_close(r._tensor, h._tensor.sum((0, 1)))


# -------------------------------------------------------------- make_left_broadcastable


def test_make_left_broadcastable_conv2d_on_sample_and_data_plates():
    torch.manual_seed(3)
    images = storch.denote_independent(torch.randn(4, 1, 6, 6), 0, "data")  # N = 4
    mu = torch.zeros(1, 6, 6, requires_grad=True)
    noise = Reparameterization("z", n_samples=3)(Normal(mu, 1.0))  # Z = 3
    inp = images + noise
    assert inp.plate_names == ["z", "data"] and inp.shape == (3, 4, 1, 6, 6)  # (Z, N, C, H, W)
    conv = torch.nn.Conv2d(1, 2, 3)
    with pytest.raises(RuntimeError):
        conv(inp)  # Conv2d accepts only one batch dimension
    wrapped = storch.make_left_broadcastable(conv)
    out = wrapped(inp)
    assert isinstance(out, storch.Tensor)
    assert out.plate_names == ["z", "data"]
    assert out.shape == (3, 4, 2, 4, 4)
    expected = torch.stack([conv(inp._tensor[i]) for i in range(3)])
    torch.testing.assert_close(out._tensor, expected)
    # gradients reach the sample's parameters and the conv weights
    storch.reduce_plates(out.sum((-1, -2, -3))).backward()
    assert mu.grad is not None and conv.weight.grad is not None


def test_make_left_broadcastable_with_one_plate_and_plain_input():
    conv = storch.make_left_broadcastable(torch.nn.Conv2d(1, 2, 3))
    x = storch.denote_independent(torch.randn(4, 1, 8, 8), 0, "data")
    assert conv(x).shape == (4, 2, 6, 6) and conv(x).plate_names == ["data"]
    plain = conv(torch.randn(4, 1, 8, 8))
    assert plain.shape == (4, 2, 6, 6)


# ---------------------------------------------------------------------------- stochastic


def test_stochastic_accepts_storch_outputs():
    @storch.stochastic
    def noisy(mu):
        return ScoreFunction("eps", n_samples=2)(Normal(mu, 1.0))

    x = _data(3, ())
    out = noisy(x)
    assert out.plate_names == ["eps", "data"]


def test_stochastic_raises_for_plain_outputs():
    @storch.stochastic
    def plain(x):
        return torch.ones(2)

    with pytest.raises(IllegalStorchExposeError, match="plain"):
        plain(torch.zeros(2))
    with pytest.raises(IllegalStorchExposeError):
        storch.stochastic(lambda x: (x * 2, torch.zeros(1)))(_z())


def test_stochastic_raises_when_an_input_plate_is_lost():
    @storch.stochastic
    def drops_plate(x):
        return ScoreFunction("eps", n_samples=2)(Normal(0.0, 1.0))

    with pytest.raises(IllegalStorchExposeError, match="data"):
        drops_plate(_data(3, ()))


def test_illegal_storch_expose_error_is_an_exception_with_message():
    err = IllegalStorchExposeError("boom")
    assert isinstance(err, Exception) and err.message == "boom"


# ---------------------------------------------------------- the steps of a wrapped call


def test_left_broadcast_batch_dims_flattens_keyword_and_nested_arguments():
    z = _z(3, (2, 4))  # plate z, then (N, F) = (2, 4)
    spy = _Spy(lambda x, state: x.sum(-1, keepdim=True) + state[0])
    out = storch.make_left_broadcastable(spy, batch_dims=1)(z, state=(torch.zeros(2, 1),))
    (x,), kwargs = spy.calls[0]
    assert type(x) is torch.Tensor and x.shape == (6, 4)
    assert kwargs["state"][0].shape == (6, 1)
    assert out.shape == (3, 2, 1) and out.plate_names == ["z"]
    torch.testing.assert_close(out._tensor, z._tensor.sum(-1, keepdim=True))


def test_left_broadcast_batch_dims_errors_name_the_shapes():
    z = _z(3, (2, 4))
    wrapped = storch.make_left_broadcastable(lambda a, b: a, batch_dims=1)
    with pytest.raises(ValueError, match=r"got shape \(7, 1\) after the plates, but an earlier argument had batch "
                       r"shape \(2,\)\."):
        wrapped(z, torch.zeros(7, 1))
    scalar = _z(3, ())
    with pytest.raises(ValueError, match=r"got shape \(\) after the plates\.$"):
        storch.make_left_broadcastable(lambda a: a, batch_dims=1)(scalar)
    with pytest.raises(ValueError, match=r"\['z'\] and the batch dimensions \(2,\) were flattened into a first "
                       r"dimension of size 6"):
        storch.make_left_broadcastable(lambda a: a[0], batch_dims=1)(z)


def test_flatten_plates_without_plates_passes_the_arguments_as_they_are():
    spy = _Spy(lambda a: 2 * a)
    x = torch.ones(2, 3)
    out = storch.deterministic(spy, flatten_plates=True)(x)
    (a,), _ = spy.calls[0]
    assert a is x
    assert isinstance(out, storch.Tensor) and out.plates == [] and out.shape == (2, 3)


def test_ignore_wrapping_returns_flattened_outputs():
    z = _z(3, (2, 4))
    with storch.wrappers.ignore_wrapping():
        out = storch.make_left_broadcastable(lambda a: 2 * a, batch_dims=1)(z)
    assert type(out) is torch.Tensor and out.shape == (6, 4)
    torch.testing.assert_close(out, 2 * z._tensor.reshape(6, 4))


def test_deterministic_on_tensor_arguments_gives_every_output_the_plates():
    """The path for tensor arguments without keywords (an environment's step on an action): a tuple of
    outputs each get the plates, a named tuple is returned as it is, and under ignore_wrapping the
    function's own outputs come back."""
    import collections

    x = _data(5, (2,))
    z = _z(3, (2,))  # the newer plate: first
    obs, reward = storch.deterministic(lambda a, b: (a * b, (a + b).sum(-1)))(z, x)
    assert obs.plate_names == ["z", "data"] and obs.shape == (3, 5, 2)
    assert reward.plate_names == ["z", "data"] and reward.shape == (3, 5)
    torch.testing.assert_close(reward.plain(), (z.plain()[:, None] + x.plain()[None]).sum(-1))
    Pair = collections.namedtuple("Pair", "first second")
    pair = storch.deterministic(lambda a: Pair(a, a * 2))(z)
    assert type(pair) is Pair and type(pair.second) is torch.Tensor
    with storch.wrappers.ignore_wrapping():
        out = storch.deterministic(lambda a: a * 2)(z)
    assert type(out) is torch.Tensor


def _recurrent_rollout(use_flat_base: bool, detach_at: int | None = None, steps: int = 6):
    """A GRU cell through make_left_broadcastable fed its own state, with a single-sample chain of
    actions (one ScoreFunction node per step); the gradients of the cell's parameters."""
    from torch.distributions import Categorical

    from storch import wrappers

    torch.manual_seed(3)
    gru, head = torch.nn.GRUCell(4, 5).double(), torch.nn.Linear(5, 3).double()
    embed = torch.nn.Embedding(4, 4).double()
    cell = storch.make_left_broadcastable(gru)
    method = storch.method.ScoreFunction("a")
    original = wrappers._flat_base
    if not use_flat_base:
        wrappers._flat_base = lambda t, union, lead: None
    try:
        h = storch.denote_independent(torch.zeros(2, 5, dtype=torch.float64), 0, "episodes")
        previous = storch.denote_independent(torch.full((2,), 3), 0, "episodes")
        for t in range(steps):
            h = cell(embed(previous), h)
            if t == detach_at:
                h = h.detach()
            action = method(Categorical(logits=head(h)))
            storch.add_cost((h.sum(-1) + action.float()) ** 2, f"c{t}")
            previous = action
        storch.backward()
    finally:
        wrappers._flat_base = original
    return [p.grad.clone() if p.grad is not None else None for p in (*gru.parameters(), *head.parameters())]


@pytest.mark.parametrize("detach_at", [None, 2])
def test_a_recurrent_state_passed_flat_gives_the_same_gradients(detach_at):
    """The cell's own earlier output is handed to it as its flat tensor (no new view): the same
    gradients as flattening it again (up to the order in which autograd sums a tensor's gradients),
    also where the user detached the state (no link comes back)."""
    fast, slow = _recurrent_rollout(True, detach_at), _recurrent_rollout(False, detach_at)
    assert all(a is not None for a in slow)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_flat_base_is_found_for_the_cell_s_own_output_only():
    from storch import wrappers
    from storch._dispatch import no_dispatch

    cell = storch.make_left_broadcastable(torch.nn.GRUCell(4, 5))
    x = storch.denote_independent(torch.randn(3, 4), 0, "data")
    h = cell(x, storch.denote_independent(torch.zeros(3, 5), 0, "data"))
    with no_dispatch():
        assert wrappers._flat_base(h, h._layout, 3) is h._base
        assert wrappers._flat_base(h * 1.0, h._layout, 3) is None  # not a view
        assert wrappers._flat_base(h.detach(), h._layout, 3) is None  # detached: no link to the graph
        assert wrappers._flat_base(h[..., :2], h._layout, 3) is None  # another view of the same tensor
        assert wrappers._flat_base(h, h._layout, 1) is None  # another flattened size
