"""The manual's API reference resolves in storch (issue 13, item 1).

Code written against the Storchastic manual's API reference (its chapters 6–10: tensors, plates,
gradient estimation methods, sampling methods, the storch package) should import unchanged.
``tests/manual_api_reference.txt`` holds the API lines of those chapters as the manual prints them
(OCR'd text, with its artefacts such as ``storch. storch.gather`` or ``weighting_ function``): every
documented class, function and exception with its module path, the members listed under each
class, and the section headings. The parser below reads them, and the tests check that

* every documented class, function and exception imports at its documented path;
* every member documented under a class resolves on it (on an instance for instance attributes
  such as ``nn.Module.training``), except the ones in :data:`NOT_PROVIDED`, which name
  Storchastic's internal decoding hooks (storch's counterparts are given there and in the
  docs/migrating.md); that list is checked to be exact, so it shrinks when one
  is added;
* names the manual's text uses outside the reference (``storch.method.baseline.BatchAverage``,
  ``Method.sample``, ``Plate.n``) resolve too;

and test the behaviour of every alias and of everything added for the manual.

As a script, on a copy of the manual::

    python tests/test_manual_api.py MANUAL.txt            # the documented names that do not resolve
    python tests/test_manual_api.py --extract MANUAL.txt  # rewrite tests/manual_api_reference.txt
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal, OneHotCategorical

import storch

REFERENCE = Path(__file__).resolve().with_name("manual_api_reference.txt")

# ============================================================================ the parser
#: a documented class, exception or function: ``class storch.method.baseline.Baseline``,
#: ``storch.wrappers.reduce (fn, plates: ...)``, ``storch. storch.gather (input: ...)``
_DEFINITION = re.compile(r"^\s*(?:(class|exception)\s+)?(storch(?:\.\s?[A-Za-z_]\w*)+)\s*(\(|$)")
#: a documented method: ``abstract compute_baseline (tensor: ...)``, ``reset()``
_METHOD = re.compile(r"^\s*(?:abstract\s+)?([a-z_][a-z0-9_]*)\s*\(")
#: a documented attribute: ``training: bool``, ``EPS = 1e-08``, ``x: Optional[storch.Tensor] = None``
#: (not a line of a wrapped signature such as ``eos=None)`` or ``parent_plate: AncestralPlate, ...:``)
_ATTRIBUTE = re.compile(r"^\s*([a-z_][a-z0-9_]*|[A-Z][A-Z0-9_]*)\s*(?::\s*[\w\[\]\.]+(?:\s*=\s*\S+)?|\s+=\s+\S+)\s*$")
#: a section heading, which ends the members of the class before it
_HEADING = re.compile(r"^\s*(CHAPTER\b|\d+\.\d+\s+[A-Z])")
#: the title of chapter 6, where the API reference begins in the full manual
_FIRST_TITLE = "STORCH TENSORS"


@dataclass(frozen=True)
class Entry:
    """A documented name: ``kind`` is ``class``, ``exception``, ``function`` or ``member``; ``path``
    the dotted path of the class, exception or function; ``member`` the member's name."""

    kind: str
    path: str
    member: Optional[str] = None

    @property
    def module(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def __str__(self) -> str:
        return f"{self.path}.{self.member}" if self.member else self.path


def _reference_lines(lines: list[str]) -> list[str]:
    """The lines from chapter 6 on (all of them if the chapter's title is not among them)."""
    for i, line in enumerate(lines):
        if line.strip() == _FIRST_TITLE:
            return lines[i:]
    return lines


def _classify(line: str, in_class: bool) -> tuple[str, Any] | None:
    """``("definition", match)``, ``("member", name)``, ``("heading", None)`` or ``None``."""
    line = re.sub(r"_\s+(?=[a-z])", "_", line)  # OCR: ``weighting_ function`` -> ``weighting_function``
    m = _DEFINITION.match(line)
    if m:
        return "definition", m
    if _HEADING.match(line):
        return "heading", None
    if in_class:
        m = _METHOD.match(line) or _ATTRIBUTE.match(line)
        if m:
            return "member", m.group(1)
    return None


def parse(text: str) -> list[Entry]:
    """The documented names of the manual's API reference, in order, without repeats."""
    entries: list[Entry] = []
    current: Optional[str] = None
    for line in _reference_lines(text.splitlines()):
        found = _classify(line, current is not None)
        if found is None:
            continue
        what, value = found
        if what == "definition":
            path = re.sub(r"\s", "", value.group(2))
            kind = value.group(1) or "function"
            entries.append(Entry(kind, path))
            current = path if kind == "class" else None
        elif what == "heading":
            current = None
        else:
            entries.append(Entry("member", current, value))  # type: ignore[arg-type]
    return list(dict.fromkeys(entries))


def extract(text: str) -> str:
    """The lines :func:`parse` reads (definitions, members, headings) of a copy of the manual."""
    kept = [
        "# The API lines (definitions, members, headings) of the Storchastic manual's chapters 6-10, as printed",
        "# (OCR'd). Written by `python tests/test_manual_api.py --extract MANUAL.txt`; read by tests/test_manual_api.py.",
    ]
    in_class = False
    for line in _reference_lines(text.splitlines()):
        found = _classify(line, in_class)
        if found is None:
            continue
        what, value = found
        if what == "definition":
            in_class = value.group(1) == "class"
        elif what == "heading":
            in_class = False
        kept.append(line.strip())
    return "\n".join(kept) + "\n"


# ============================================================================ resolving
#: Documented members storch does not provide: Storchastic's internal hooks of its decoders and
#: plates, whose work storch does elsewhere. Each names storch's counterpart.
NOT_PROVIDED = {
    "storch.sampling.method.SamplingMethod.on_plate_already_present":
        "Method.forward refuses a distribution that already carries the node's plate; sequence "
        "methods (ScoreFunctionWOR) continue an ancestral plate themselves",
    "storch.sampling.seq.AncestralPlate.index_in": "plates are found with PlateLayout.index",
    "storch.sampling.seq.AncestralPlate.is_in": "plates are compared with == (AncestralPlate: identity)",
    "storch.sampling.seq.AncestralPlate.on_collecting_args":
        "merge_layouts keeps the newest step of an ancestral chain",
    "storch.sampling.seq.AncestralPlate.on_duplicate_plate": "merge_layouts (PlateClashError)",
    "storch.sampling.seq.AncestralPlate.on_unwrap_tensor":
        "older steps are re-indexed along parent_index by the dispatcher",
    "storch.sampling.seq.IterDecoding.decode": "SequenceSampler.draw / extend",
    "storch.sampling.seq.IterDecoding.decode_step": "SequenceSampler.draw / extend",
    "storch.sampling.seq.MCDecoder.decode": "MCDecoder.draw / extend",
    "storch.sampling.seq.SequenceDecoding.EPS": "no epsilon: weights are computed in log space",
    "storch.sampling.seq.SequenceDecoding.all_finished": "WORState.finished of a step's plate",
    "storch.sampling.seq.SequenceDecoding.create_plate": "ScoreFunctionWOR creates each step's AncestralPlate",
    "storch.sampling.seq.SequenceDecoding.decode": "SequenceSampler.draw / extend",
    "storch.sampling.seq.SequenceDecoding.get_amt_finished": "WORState.finished of a step's plate",
    "storch.sampling.seq.SequenceDecoding.get_sampled_seq":
        "the caller keeps the tokens; tensors of earlier steps are lined up with the newest automatically",
    "storch.sampling.seq.SequenceDecoding.get_unique_seqs": "none (Storchastic's was experimental)",
    "storch.sampling.swor.SampleWithoutReplacement.EPS": "no epsilon: weights are computed in log space",
    "storch.sampling.swor.SampleWithoutReplacement.compute_iw": "SampleWithoutReplacement.weights",
    "storch.sampling.swor.SampleWithoutReplacement.create_plate": "ScoreFunctionWOR creates each step's AncestralPlate",
    "storch.sampling.swor.SampleWithoutReplacement.decode_step": "SampleWithoutReplacement.draw / extend",
    "storch.sampling.swor.SampleWithoutReplacement.on_plate_already_present":
        "ScoreFunctionWOR continues an ancestral plate",
    "storch.sampling.swor.SampleWithoutReplacement.perturbed_log_probs": "SequenceSampler.state_of(tensor).perturbed",
    "storch.sampling.swor.SampleWithoutReplacement.select_samples": "gumbel_top_k_step",
    "storch.sampling.swor.SumAndSample.select_samples": "SumAndSampleRest.sample",
}

#: Names the manual uses outside its API reference (tutorial chapters; ``Method.sample`` in its
#: text), and ``Plate.n``, Storchastic's name for the plate size.
MANUAL_TEXT_NAMES = [
    "storch.method.baseline.BatchAverage",
    "storch.method.Method.sample",
    "storch.method.method.Method.sample",
    "storch.Plate.n",
    "storch.tensor.Plate.n",
    "storch.StochasticTensor.n",
]



def _import(dotted: str) -> Any:
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _instance(cls: type) -> Any:
    """An instance of ``cls`` (or of its first concrete subclass), built as ``cls("z", 2)``."""
    candidates = [cls]
    while candidates:
        c = candidates.pop(0)
        if not inspect.isabstract(c):
            for args in (("z", 2), ("z",), ()):
                try:
                    return c(*args)
                except TypeError:
                    pass
        candidates += c.__subclasses__()
    raise TypeError(f"cannot build an instance of {cls.__name__}")


def unresolved(entry: Entry) -> Optional[str]:
    """Why ``entry`` does not resolve at its documented path, or ``None``."""
    try:
        module = importlib.import_module(entry.module)
    except ImportError as error:
        return f"no module {entry.module} ({error})"
    if not hasattr(module, entry.name):
        return f"{entry.module} has no {entry.name}"
    obj = getattr(module, entry.name)
    if entry.kind == "class" and not isinstance(obj, type):
        return f"{entry.path} is not a class"
    if entry.kind == "exception" and not (isinstance(obj, type) and issubclass(obj, BaseException)):
        return f"{entry.path} is not an exception"
    if entry.kind == "function" and not callable(obj):
        return f"{entry.path} is not callable"
    if entry.member is not None and not hasattr(obj, entry.member):
        if not isinstance(obj, type):
            return f"{entry} does not exist"
        try:
            instance = _instance(obj)
        except TypeError:
            return f"{entry} does not exist (on the class; no instance to look at)"
        if not hasattr(instance, entry.member):
            return f"{entry} does not exist"
    return None


def documented() -> list[Entry]:
    """The names of ``tests/manual_api_reference.txt`` (none if it is missing: the count test fails)."""
    return parse(REFERENCE.read_text(encoding="utf-8")) if REFERENCE.exists() else []


DOCUMENTED = documented()
DEFINITIONS = [e for e in DOCUMENTED if e.member is None]
MEMBERS = [e for e in DOCUMENTED if e.member is not None and str(e) not in NOT_PROVIDED]


# ============================================================================ the reference
def test_the_reference_is_parsed_completely():
    kinds = {kind: sum(e.kind == kind for e in DOCUMENTED) for kind in ("class", "function", "exception", "member")}
    assert kinds == {"class": 15, "function": 34, "exception": 1, "member": 60}, kinds
    paths = {str(e) for e in DOCUMENTED}
    for name in (
        "storch.tensor.IndependentTensor.stochastic", "storch.storch.gather", "storch.sampling.swor.loglmexp",
        "storch.sampling.unordered_set.UnorderedSet.weighting_function", "storch.sampling.seq.SequenceDecoding.EPS",
        "storch.sampling.swor.SampleWithoutReplacement.perturbed_log_probs", "storch.wrappers.ignore_wrapping",
    ):
        assert name in paths, name
    # lines of wrapped signatures are not members
    assert "storch.sampling.swor.SampleWithoutReplacement.eos" not in paths
    assert "storch.sampling.unordered_set.GumbelSoftmaxWOR.initial_temperature" not in paths


def test_the_parser_reads_the_manuals_format():
    text = "\n".join([
        "STORCH TENSORS",
        "class storch.method.baseline.Baseline",
        "Bases: ABC, Module",
        "abstract compute_baseline (tensor: StochasticTensor, cost_node: CostTensor) — Tensor",
        "training: bool",
        "Note: Although the recipe for forward pass needs to be defined within this function,",
        "weighting_ function(tensor: StochasticTensor, plate: Plate) — Optional[Tensor]",
        "EPS = le-08",
        "eos=None)",
        "9.3 Sampling without replacement",
        "reset()",
        "storch. storch.gather (input: Tensor, dim: str, index: Tensor)",
        "This method is called from storch.method.Method.sample, and it is not needed",
        "exception storch.exceptions.IllegalStorchExposeError (message)",
    ])
    assert [str(e) for e in parse(text)] == [
        "storch.method.baseline.Baseline", "storch.method.baseline.Baseline.compute_baseline",
        "storch.method.baseline.Baseline.training", "storch.method.baseline.Baseline.weighting_function",
        "storch.method.baseline.Baseline.EPS", "storch.storch.gather", "storch.exceptions.IllegalStorchExposeError",
    ]
    assert parse(extract(text)) == parse(text)


# ============================================================================ it resolves
@pytest.mark.parametrize("entry", DEFINITIONS, ids=str)
def test_every_documented_name_imports_at_its_documented_path(entry: Entry):
    assert unresolved(entry) is None, unresolved(entry)


@pytest.mark.parametrize("entry", MEMBERS, ids=str)
def test_every_documented_member_resolves(entry: Entry):
    assert unresolved(entry) is None, unresolved(entry)


def test_the_members_not_provided_are_documented_and_absent():
    members = {str(e): e for e in DOCUMENTED if e.member is not None}
    for name in NOT_PROVIDED:
        assert name in members, f"{name} is not in the manual's reference: remove it from NOT_PROVIDED"
        assert unresolved(members[name]) is not None, f"{name} exists now: remove it from NOT_PROVIDED"


@pytest.mark.parametrize(
    "name",
    MANUAL_TEXT_NAMES,
)
def test_names_used_in_the_manuals_text_resolve(name: str):
    obj = _import(name.rpartition(".")[0])
    assert hasattr(obj, name.rpartition(".")[2]), name


# ============================================================================ aliases behave
def test_storch_storch_reexports_storchs_functions():
    import storch.storch as ss

    for name in ss.__all__:
        assert getattr(ss, name) is getattr(storch, name), name
    x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 5.0]]), 0, "data")
    assert ss.reduce_plates(x, "data").tolist() == [2.0, 3.5]
    assert ss.sum(x, "data").tolist() == [4.0, 7.0]
    assert ss.cat([x, x], -1).shape == (2, 4)


def test_sequence_decoding_aliases_are_storchs_classes():
    from storch.plate import AncestralPlate
    from storch.sampling import decoding, seq, swor

    assert seq.AncestralPlate is AncestralPlate
    assert seq.SequenceDecoding is swor.SequenceSampler and seq.IterDecoding is swor.SequenceSampler
    assert seq.MCDecoder is decoding.MCDecoder
    assert issubclass(swor.SampleWithoutReplacement, seq.IterDecoding)
    assert issubclass(seq.MCDecoder, seq.SequenceDecoding)
    assert issubclass(seq.AncestralPlate, storch.Plate)


def test_mc_decoder_at_the_manuals_path_decodes_a_sequence():
    from storch.method.score_function_wor import ScoreFunctionWOR
    from storch.sampling.seq import AncestralPlate, MCDecoder

    theta = torch.tensor([0.3, -0.2, 0.1], requires_grad=True)
    method = ScoreFunctionWOR("seq", 4, sampling_method=MCDecoder("seq", 4, eos=0))
    x1 = method(Categorical(logits=theta))
    x2 = method(Categorical(logits=theta + x1.unsqueeze(-1).float()))
    step = x2.plates[0]
    assert isinstance(step, AncestralPlate) and step.ancestor is x1.plates[0] and step.size == 4
    assert (x1 + x2).plates[0] is step  # the first step is lined up with the second
    storch.add_cost((x1 + x2).float(), "length")
    storch.backward()
    assert theta.grad is not None and torch.isfinite(theta.grad).all()


def test_unordered_set_path_holds_storchs_classes_and_samples_sets():
    from storch.method import ScoreFunction
    from storch.sampling import unordered_set

    assert unordered_set.UnorderedSet is storch.sampling.UnorderedSet
    assert unordered_set.GumbelSoftmaxWOR is storch.sampling.GumbelSoftmaxWOR
    z = ScoreFunction("z", sampling_method=unordered_set.UnorderedSet("z", 3))(Categorical(logits=torch.zeros(6)))
    assert z.n == 3 and len(set(z._tensor.tolist())) == 3
    logits = torch.zeros(4, requires_grad=True)
    y = unordered_set.GumbelSoftmaxWOR("y", 2).sample(OneHotCategorical(logits=logits), (), True)
    assert y.shape == (2, 4) and y.requires_grad
    with pytest.raises(TypeError, match=r"the third argument is the integration step .* comp_leave_two_out"):
        unordered_set.UnorderedSet("z", 3, True)  # Storchastic's comp_leave_two_out in storch's step slot


def test_batch_average_is_the_batch_average_baseline():
    from storch.method import ScoreFunction
    from storch.method.baseline import BatchAverage, BatchAverageBaseline

    assert BatchAverage is BatchAverageBaseline
    method = ScoreFunction("z", 4, baseline_factory=BatchAverage)  # a baseline class as the factory
    assert isinstance(method.baseline, BatchAverageBaseline)
    with pytest.raises(ValueError, match="at least 2 samples"):
        ScoreFunction("z", 1, baseline_factory=BatchAverage)
    # the baseline of sample j is the mean cost of the other samples
    x = method(Bernoulli(torch.tensor(0.4, requires_grad=True)))
    cost = 10.0 * x + torch.tensor(1.0)
    values = cost._tensor
    baseline = method.baseline.compute_baseline(x, cost)
    assert baseline.plate_names == ["z"] and torch.allclose(baseline._tensor, (values.sum() - values) / 3)


def test_method_sample_draws_as_calling_the_method():
    from storch.method import Method, Reparameterization, ScoreFunction
    from storch.method.score_function_wor import ScoreFunctionWOR

    assert Method.sample is storch.method.method.Method.sample
    mu = torch.tensor([0.5, -1.0], requires_grad=True)
    torch.manual_seed(0)
    a = Reparameterization("z", n_samples=3)(Normal(mu, 1.0))
    storch.reset()
    torch.manual_seed(0)
    b = Reparameterization("z", n_samples=3).sample(Normal(mu, 1.0))
    assert type(b) is type(a) and b.plates[0].name == "z" and torch.equal(a._tensor, b._tensor)
    storch.add_cost((b**2).sum(-1), "f")
    storch.backward()
    assert torch.allclose(mu.grad, 2 * b._tensor.detach().mean(0), atol=1e-6)
    # forward hooks run, and subclasses that override forward are used
    seen = []
    method = ScoreFunction("x", n_samples=2)
    method.register_forward_hook(lambda module, args, out: seen.append(out))
    x = method.sample(Bernoulli(torch.tensor(0.5)))
    assert len(seen) == 1 and seen[0] is x
    storch.reset()
    wor = ScoreFunctionWOR("s", 3)
    s = wor.sample(Categorical(logits=torch.zeros(5)))
    assert s.n == 3 and len(set(s._tensor.tolist())) == 3


# ============================================================================ new helpers behave
def test_loglmexp_is_log1mexp_and_computes_log_one_minus_exp_stably():
    from storch.sampling.swor import log1mexp, loglmexp

    assert loglmexp is log1mexp
    x = torch.tensor([-1e-10, -1e-5, -0.3, -0.69, -0.7, -2.0, -20.0, -50.0])
    reference = torch.tensor([math.log(-math.expm1(v)) if v > -math.log(2) else math.log1p(-math.exp(v)) for v in x.tolist()],
                             dtype=torch.float64)
    assert torch.allclose(loglmexp(x).double(), reference, rtol=1e-6, atol=0)
    assert torch.allclose(loglmexp(x.double()), reference, rtol=1e-14, atol=0)
    naive = torch.log(1 - torch.exp(x))  # loses everything at both ends in float32
    assert torch.isinf(naive[0]) and naive[-1] == 0.0
    assert loglmexp(torch.tensor(0.0)) == -math.inf and torch.isnan(loglmexp(torch.tensor(0.5)))
    # its derivative, -1 / (exp(-x) - 1), is finite below 0
    xs = x.double().clone().requires_grad_()
    loglmexp(xs).sum().backward()
    assert torch.allclose(xs.grad, -1 / torch.expm1(-xs.detach()), rtol=1e-9)


def test_cond_gumbel_sample_has_the_required_maximum_and_argmax_distribution():
    from storch.sampling.swor import cond_gumbel_sample

    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    lp = p.log().expand(40000, 5).clone().requires_grad_()
    top = torch.linspace(-2.0, 3.0, 40000)
    g = cond_gumbel_sample(lp, top)
    assert torch.allclose(g.max(-1).values, top, atol=1e-5)
    assert torch.isneginf(g[:, 4]).all()  # a value of probability 0 stays impossible
    # given its maximum, the argmax of Gumbel-perturbed log-probabilities is still distributed as p
    freq = torch.bincount(g.argmax(-1), minlength=5).double() / 40000
    assert torch.allclose(freq, p.double(), atol=0.01)
    g[:, :4].sum().backward()  # reparameterised
    assert torch.isfinite(lp.grad).all()
    assert cond_gumbel_sample(torch.zeros(3), 0.0).max() == 0.0  # a scalar maximum (the root of a beam)


def test_is_iterable():
    from storch.wrappers import is_iterable

    x = storch.denote_independent(torch.zeros(2, 3), 0, "data")
    assert all(is_iterable(v) for v in ([1], (x,), {"a": x}, {1, 2}, range(3), (i for i in range(2))))
    assert not any(is_iterable(v) for v in (x, torch.zeros(3), "abc", b"ab", 3, 2.5, None, torch.zeros(2).untyped_storage()))


def test_ignore_wrapping_returns_the_wrapped_functions_plain_outputs():
    from storch.wrappers import ignore_wrapping

    x = storch.denote_independent(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), 0, "data")
    y = storch.denote_independent(torch.tensor([10.0, 20.0]), 0, "other")
    add = storch.deterministic(lambda a, b: a + b.unsqueeze(-1))
    wrapped = add(x, y)
    assert wrapped.plate_names == ["other", "data"]
    with ignore_wrapping():
        plain = add(x, y)  # aligned over both plates, not wrapped again
        flat = storch.deterministic(lambda a: a * 2, flatten_plates=True)(x)
        with ignore_wrapping():  # nested blocks
            inner = storch.reduce(torch.sum, "data")(x)
        after_inner = add(x, y)
        torch_op = x * 2  # torch operations on storch tensors are not affected
    assert type(plain) is torch.Tensor and torch.equal(plain, wrapped._tensor)
    assert type(flat) is torch.Tensor and flat.shape == (3, 2)
    assert type(inner) is torch.Tensor and inner.tolist() == [9.0, 12.0]
    assert type(after_inner) is torch.Tensor
    assert isinstance(torch_op, storch.Tensor)
    assert isinstance(add(x, y), storch.Tensor)  # restored after the block
    with pytest.raises(RuntimeError):
        with ignore_wrapping():
            raise RuntimeError("boom")
    assert isinstance(add(x, y), storch.Tensor)  # restored after an exception too


def test_expand_helpers_on_plain_tensors():
    from storch.sampling.seq import expand_with_ignore_as, left_expand_as, right_expand_as

    t = torch.tensor([[1, 2], [3, 4]])
    r = right_expand_as(t, torch.zeros(2, 2, 3))
    assert r.shape == (2, 2, 3) and torch.equal(r[..., 2], t)
    l = left_expand_as(t, torch.zeros(5, 2, 7))  # noqa: E741
    assert l.shape == (5, 2, 2) and torch.equal(l[4], t)
    assert left_expand_as(torch.arange(3), torch.zeros(2, 4, 3)).shape == (2, 4, 3)
    # the manual's example: a x b like d x a x c ignoring the last dimension gives d x a x b
    e = expand_with_ignore_as(torch.arange(8).reshape(4, 2), torch.zeros(3, 4, 7), -1)
    assert e.shape == (3, 4, 2) and torch.equal(e[1], torch.arange(8).reshape(4, 2))
    assert expand_with_ignore_as(torch.zeros(2, 1), torch.zeros(3, 4, 7), 1).shape == (3, 2, 7)
    with pytest.raises(ValueError, match="more dimensions"):
        right_expand_as(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(IndexError, match="out of range"):
        expand_with_ignore_as(torch.zeros(2), torch.zeros(3, 2), 5)
    with pytest.raises(TypeError, match="ignore_dim must be"):
        expand_with_ignore_as(torch.zeros(2), torch.zeros(3, 2), 1.0)


def test_expand_helpers_align_plates_and_work_on_event_dimensions():
    from storch.sampling.seq import expand_with_ignore_as, left_expand_as, right_expand_as

    x = storch.denote_independent(torch.arange(6.0).reshape(3, 2), 0, "data")  # plate data, event (2,)
    big = storch.denote_independent(torch.zeros(3, 2, 5), 0, "data")  # plate data, event (2, 5)
    r = right_expand_as(x, big)
    assert r.plate_names == ["data"] and r.shape == (3, 2, 5) and torch.equal(r._tensor[..., 4], x._tensor)
    l = left_expand_as(torch.arange(5.0), big)  # noqa: E741  a plain tensor: its dims are event dims
    assert l.plate_names == ["data"] and l.shape == (3, 2, 5) and torch.equal(l._tensor[2, 1], torch.arange(5.0))
    # plates of both arguments are aligned and expanded
    other = storch.denote_independent(torch.zeros(4, 7), 0, "other")  # plate other, event (7,)
    e = expand_with_ignore_as(x, other, -1)  # event (2,) kept in the ignored dimension
    assert e.plate_names == ["other", "data"] and e.shape == (4, 3, 2)
    assert torch.equal(e._tensor[3], x._tensor)
    wide = storch.denote_independent(torch.zeros(3, 5, 2), 0, "data")  # plate data, event (5, 2)
    by_name = expand_with_ignore_as(x, wide, "data")  # event dimensions line up on the right
    assert by_name.plate_names == ["data"] and by_name.shape == (3, 5, 2)
    assert torch.equal(by_name._tensor[:, 4], x._tensor)
    with pytest.raises(ValueError, match="no plate named 'nope'"):
        expand_with_ignore_as(x, big, "nope")


# ============================================================================ SumAndSample
def test_sum_and_sample_is_sum_and_sample_rest_with_the_manuals_constructor():
    from storch.method.rao_blackwell import SumAndSampleRest as FromMethod
    from storch.sampling.swor import SumAndSample, SumAndSampleRest

    assert FromMethod is SumAndSampleRest and issubclass(SumAndSample, SumAndSampleRest)
    s = SumAndSample("z", 3, 2)
    assert (s.sum_size, s.sample_size, s.k, s.n_sampled, s.n_samples, s.without_replacement) == (3, 2, 4, 2, 5, False)
    assert SumAndSample("z", 1, without_replacement=True).without_replacement
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    x = s.sample(Categorical(probs=p), (), False)
    assert x[:3].tolist() == [1, 3, 4] and not any(v in (1, 3, 4) for v in x[3:].tolist())
    with pytest.raises(TypeError, match=r"^SumAndSample\('z'\): sum_size must be a positive int, got 2.5"):
        SumAndSample("z", 2.5)
    with pytest.raises(ValueError, match=r"^SumAndSample\('z'\): sample_size must be at least 1"):
        SumAndSample("z", 2, 0)
    with pytest.raises(ValueError, match="eos=2 is for sequences"):
        SumAndSample("z", 2, eos=2)
    with pytest.raises(ValueError, match=r"only 5 values; use sum_size <= 2"):
        SumAndSample("z", 3, 3, without_replacement=True).sample(Categorical(probs=p), (), False)
    with pytest.raises(ValueError, match=r"only 5 values; use sum_size <= 4"):
        SumAndSample("z", 5).sample(Categorical(probs=p), (), False)


@pytest.mark.parametrize("without_replacement", [False, True], ids=["iid", "wor"])
def test_sum_and_sample_is_unbiased(without_replacement):
    from problems import one_categorical

    from storch.method import ScoreFunction
    from storch.sampling.swor import SumAndSample
    from storch.testing import assert_unbiased, replicated_gradients

    problem = one_categorical(6)
    method = ScoreFunction("z", sampling_method=SumAndSample("z", 2, 2, without_replacement=without_replacement))
    (grads,) = replicated_gradients([problem.theta], 3000, problem.model(method, one_hot=False))
    assert_unbiased(grads, problem.exact())


def test_sum_and_sample_without_replacement_weights():
    from storch.method import ScoreFunction
    from storch.sampling.swor import SumAndSample

    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    v = torch.tensor([1.0, -2.0, 4.0, 0.5, 3.0])
    # all the remaining values: exact, weights p(x)
    z = ScoreFunction("z", sampling_method=SumAndSample("z", 2, 3, without_replacement=True))(Categorical(probs=p))
    w = z.plate.weight._tensor
    assert sorted(z._tensor.tolist()) == [0, 1, 2, 3, 4] and torch.allclose(w, p[z._tensor])
    storch.reset()
    # fewer: distinct values, weights p(x)/q_kappa(x); the estimate is unbiased
    logits = storch.denote_independent(p.log().expand(20000, 5), 0, "r")
    z = ScoreFunction("z", sampling_method=SumAndSample("z", 1, 2, without_replacement=True))(Categorical(logits=logits))
    values = z._tensor
    assert (values[1] != values[2]).all() and (values[1:] != 1).all()
    w = z.plate.weight._tensor
    assert torch.allclose(w[0], torch.tensor(0.4)) and (w[1:] >= p[values[1:]] * (1 - 1e-6)).all()  # p/q, q <= 1
    estimates = (w * v[values]).sum(0)
    exact = (p * v).sum()
    assert abs(estimates.mean() - exact) < 4.5 * estimates.std() / 20000**0.5


# ============================================================================ constructors
def test_sample_without_replacement_takes_biased_iw():
    from storch.sampling.swor import SampleWithoutReplacement

    assert SampleWithoutReplacement("z", 3, biased_iw=True).normalize
    assert not SampleWithoutReplacement("z", 3, biased_iw=False).normalize
    assert SampleWithoutReplacement("z", 3, True).normalize  # positionally, as in the manual
    with pytest.raises(ValueError, match="biased_iw is the manual's name for normalize"):
        SampleWithoutReplacement("z", 3, normalize=True, biased_iw=False)
    s = SampleWithoutReplacement("z", 3, biased_iw=True)
    z = storch.method.ScoreFunction("z", sampling_method=s)(Categorical(logits=torch.tensor([0.0, 1.0, -1.0, 0.5])))
    assert torch.allclose(z.plate.weight._tensor.sum(), torch.tensor(1.0))  # normalised importance weights


def test_relax_and_lax_build_the_default_network_from_in_dim():
    from storch.method import LAX, RELAX
    from storch.method.relax import ControlVariateNetwork

    logits = torch.zeros(2, 3, requires_grad=True)
    method = RELAX("z", in_dim=(2, 3), n_samples=4)
    assert isinstance(method.network, ControlVariateNetwork) and method.network.in_dim == (2, 3)
    z = method(OneHotCategorical(logits=logits))
    storch.add_cost((z * torch.arange(3.0)).sum((-1, -2)), "f")
    before = method.network.net[0].weight.detach().clone()
    storch.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert not torch.equal(before, method.network.net[0].weight)  # the network is trained

    mu = torch.zeros(3, requires_grad=True)
    lax = LAX("x", in_dim=3, n_samples=5)
    assert lax.network.in_dim == (3,)
    x = lax(Normal(mu, 1.0))
    storch.add_cost((x > 0).float().sum(-1), "g")
    storch.backward()
    assert mu.grad is not None and torch.isfinite(mu.grad).all()


def test_relax_lax_rebar_take_c_phi():
    from storch.method import LAX, REBAR, RELAX

    net = nn.Linear(3, 1)
    assert RELAX("z", c_phi=net).network is net and LAX("z", c_phi=net).network is net
    rebar = REBAR("b", c_phi=net, n_samples=2)
    assert rebar.network is net and rebar.rebar
    b = rebar(Bernoulli(logits=torch.zeros(3, requires_grad=True)))
    assert b.n == 6  # groups [b, σ(z), σ(z̃)]
    with pytest.raises(ValueError, match="control_variate and c_phi are all ways to give the control variate"):
        RELAX("z", net, c_phi=net)
    with pytest.raises(ValueError, match="c_phi and in_dim"):
        LAX("z", c_phi=net, in_dim=3)
    with pytest.raises(TypeError, match="c_phi must be an nn.Module"):
        RELAX("z", c_phi=lambda x: x.sum(-1))
    with pytest.raises(ValueError, match=r"LAX\('z'\) needs a control variate"):
        LAX("z")
    with pytest.raises(ValueError, match="in_dim must be a positive int"):
        RELAX("z", in_dim=0)
    b = RELAX("z", in_dim=4, n_samples=2)(Bernoulli(logits=torch.zeros(3, requires_grad=True)))
    storch.add_cost(b.sum(-1), "f")
    with pytest.raises(ValueError, match=r"expected an input ending in dimensions \(4,\)"):
        storch.backward()  # the network runs in the estimator


def test_a_positional_count_after_the_plate_name_is_n_samples():
    from storch.method import Expect, ScoreFunction
    from storch.sampling.expect import Enumerate
    from storch.sampling.method import MonteCarlo

    assert ScoreFunction("z", 8).n_samples == 8  # ScoreFunction(plate_name, n_samples) as the manual writes it
    assert MonteCarlo("z", 8).n_samples == 8 and Enumerate("z", 8).budget == 8 and Expect("z", 8).sampling_method.budget == 8


# ============================================================================ as a script
def _report(entries: Iterable[Entry]) -> list[str]:
    return [f"{e}: {why}" for e in entries if (why := unresolved(e)) is not None]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--extract":
        REFERENCE.write_text(extract(Path(argv[1]).read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote {REFERENCE}")
        return 0
    text = Path(argv[0]).read_text(encoding="utf-8") if argv else REFERENCE.read_text(encoding="utf-8")
    entries = parse(text)
    lines = _report(entries)
    print(f"{len(entries)} documented names, {len(lines)} unresolved")
    for line in lines:
        print(("  (not provided) " if line.split(":")[0] in NOT_PROVIDED else "  ") + line)
    return 1 if any(line.split(":")[0] not in NOT_PROVIDED for line in lines) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))


def test_plate_n_is_the_plate_size():
    from torch.distributions import Normal

    import storch
    from storch.plate import Plate

    assert Plate("x", 3).n == 3
    z = storch.method.Reparameterization("z", n_samples=5)(Normal(0.0, 1.0))
    assert z.plates[0].n == z.n == 5
    storch.reset()


# ============================================================= names Storchastic users reach for
#: names a migrating user reaches for outside the manual's API reference, all provided by storch;
#: each is also listed on the migration page (docs/migrating.md)
PROVIDED_NAMES = [
    "storch.is_tensor",
    "storch.IllegalStorchExposeError",
    "storch.method.GumbelSparseMax",
    "storch.method.GumbelEntmax",
    "storch.Tensor.detach_tensor",
]
#: Storchastic's keywords that storch takes, by callable
STORCHASTIC_KEYWORDS = {
    "storch.method.Infer": ["distribution_type"],
    "storch.method.ScoreFunctionWOR": ["use_baseline"],
    "storch.method.GumbelEntmax": ["alpha", "adaptive"],
    "storch.backward": ["debug", "update_estimator_params", "print_costs"],
}
MIGRATING_PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"


def _resolve(path: str) -> Any:
    module, _, rest = path.partition(".")
    obj: Any = importlib.import_module(module)
    for part in rest.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("path", PROVIDED_NAMES)
def test_names_migrating_users_reach_for_resolve_and_are_listed(path: str):
    _resolve(path)
    short = path.removeprefix("storch.Tensor.").rsplit(".", 1)[-1]
    assert short in MIGRATING_PAGE.read_text(encoding="utf-8"), f"{path} is not on the migration page"


@pytest.mark.parametrize("path", sorted(STORCHASTIC_KEYWORDS))
def test_storchastic_keywords_are_taken_and_listed(path: str):
    parameters = inspect.signature(_resolve(path)).parameters
    page = MIGRATING_PAGE.read_text(encoding="utf-8")
    for keyword in STORCHASTIC_KEYWORDS[path]:
        assert keyword in parameters, f"{path} does not take {keyword}="
        assert keyword in page, f"{path}({keyword}=...) is not on the migration page"


def test_is_tensor_and_detach_tensor():
    z = storch.method.ScoreFunction("z", n_samples=3)(Bernoulli(torch.tensor(0.5, requires_grad=True)))
    assert storch.is_tensor(z) and storch.is_tensor(torch.ones(1))  # any tensor, as in Storchastic
    assert storch.is_storch(z) and not storch.is_storch(torch.ones(1))
    raw = z.detach_tensor()
    assert type(raw) is torch.Tensor and not raw.requires_grad and raw.shape == (3,)
    assert torch.equal(raw, z._tensor)
    storch.reset()


def test_truth_value_of_several_samples_is_an_illegal_expose():
    z = storch.method.ScoreFunction("z", n_samples=3)(Bernoulli(torch.tensor(0.5)))
    with pytest.raises(storch.IllegalStorchExposeError, match="'z' \\(size 3\\)"):
        if z:
            pass
    with pytest.raises(ValueError):  # still a ValueError, as torch's own ambiguous truth value
        float(z)
    assert storch.IllegalStorchExposeError is storch.exceptions.IllegalStorchExposeError
    one = storch.method.ScoreFunction("one", n_samples=1)(Bernoulli(torch.tensor(1.0)))
    assert bool(one)  # a single sample is one value
    storch.reset()


def test_backward_is_keyword_only_and_a_positional_call_names_both_meanings():
    p = torch.tensor(0.3, requires_grad=True)
    storch.add_cost(5.0 * storch.method.Expect("x")(Bernoulli(p)), "f")
    with pytest.raises(TypeError, match="debug.*create_graph"):
        storch.backward(True)
    assert storch.registered_costs() == ()  # nothing left over from the failed call
    assert p.grad is None


def test_backward_takes_storchastics_debug_and_update_estimator_params(capsys):
    p = torch.tensor(0.3, requires_grad=True)
    method = storch.method.ScoreFunction("x", n_samples=1, baseline_factory="moving_average")
    storch.add_cost(5.0 * method(Bernoulli(p)), "f")
    storch.backward(debug=True, update_estimator_params=False)
    assert capsys.readouterr().out.startswith("f: ")
    before = [b.clone() for b in method.buffers()]
    storch.add_cost(5.0 * method(Bernoulli(p)), "f")
    storch.backward(update_estimator_params=False)
    assert all(torch.equal(a, b) for a, b in zip(before, method.buffers()))  # the baseline did not move
    storch.add_cost(5.0 * method(Bernoulli(p)), "f")
    storch.backward(update_estimator_params=True)
    assert any(not torch.equal(a, b) for a, b in zip(before, method.buffers()))


def test_infer_takes_storchastics_distribution_type():
    from storch.method import Infer

    assert Infer("z", Normal).distribution_type is Normal
    method = Infer("z", Normal, None, 4)  # Storchastic's positional (type, sampling_method, n_samples)
    assert method.n_samples == 4
    assert Infer("z", Normal, baseline_factory="moving_average").n_samples == 1
    z = method(Normal(torch.tensor(0.0, requires_grad=True), 1.0))
    assert z.n == 4 and type(z.method).__name__ == "Reparameterization"
    with pytest.raises(TypeError, match="built for Normal.*called with a Bernoulli"):
        method(Bernoulli(torch.tensor(0.3)))
    with pytest.raises(TypeError, match="distribution_type must be"):
        Infer("z", distribution_type=3)
    storch.reset()


def _wor_gradient(seed: int, k: int, **kwargs: Any) -> torch.Tensor:
    torch.manual_seed(seed)
    logits = torch.tensor([0.3, -0.2, 0.5, 0.1], requires_grad=True)
    z = storch.method.ScoreFunctionWOR("z", k=k, **kwargs)(OneHotCategorical(logits=logits))
    storch.add_cost((z * torch.tensor([1.0, 4.0, -2.0, 3.0])).sum(-1), "f")
    storch.backward()
    return logits.grad


def test_score_function_wor_takes_use_baseline():
    with pytest.raises(ValueError, match="use_baseline=True needs biased=True"):
        storch.method.ScoreFunctionWOR("z", k=2, use_baseline=True)
    assert storch.method.ScoreFunctionWOR("z", k=2, biased=True).use_baseline
    assert not storch.method.ScoreFunctionWOR("z", k=2).use_baseline
    # k covers the support: the normalised estimator is exact with or without its baseline
    logits = torch.tensor([0.3, -0.2, 0.5, 0.1], requires_grad=True)
    exact = torch.autograd.grad((logits.softmax(-1) * torch.tensor([1.0, 4.0, -2.0, 3.0])).sum(), logits)[0]
    for use_baseline in (True, False):
        grad = _wor_gradient(0, 4, biased=True, use_baseline=use_baseline)
        assert torch.allclose(grad, exact, atol=1e-5), use_baseline
    # fewer samples: the same draws, with and without the built-in baseline, differ
    with_b = _wor_gradient(1, 2, biased=True)
    without_b = _wor_gradient(1, 2, biased=True, use_baseline=False)
    assert not torch.allclose(with_b, without_b)


def test_more_than_64_costs_of_independent_nodes():
    """Each cost is reduced over its own plates: independent nodes never meet in one tensor."""
    p = torch.tensor(0.5, requires_grad=True)
    for i in range(100):
        storch.add_cost(storch.method.Expect(f"s{i}")(Bernoulli(p)) * float(i), f"c{i}")
    total = storch.backward()
    assert torch.allclose(total, torch.tensor(0.5 * sum(range(100))))
    assert torch.allclose(p.grad, torch.tensor(float(sum(range(100)))))
    q = torch.tensor(0.5, requires_grad=True)
    for i in range(65):  # the score function, as in a rollout with a reward per step
        storch.add_cost(storch.method.ScoreFunction(f"s{i}")(Bernoulli(q)), f"c{i}")
    storch.backward()
    assert q.grad is not None and torch.isfinite(q.grad)
