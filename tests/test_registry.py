"""storch.registry.TypeRegistry and the eleven registries built on it (issue 12, item 3).

The registry: most specific match, subclasses inherit, ambiguity under multiple inheritance is an
error naming the registry, the type, the candidates and the fix, a second registration is an error
unless ``replace=True``. The registries: each holds the built-in entries it held before they were
all moved onto :meth:`TypeRegistry.register`, and each public ``register_*`` function goes through
it (double registration refused, ``replace=True`` accepted).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.distributions import (
    Bernoulli,
    Beta,
    Categorical,
    Chi2,
    Dirichlet,
    Distribution,
    Exponential,
    Gamma,
    Independent,
    Laplace,
    Normal,
    OneHotCategorical,
    Poisson,
)

from storch.distributions.dirac import Dirac
from storch.registry import AmbiguousLookupError, DuplicateRegistrationError, TypeRegistry


# --------------------------------------------------------------------------- the registry
class Base:
    pass


class Left(Base):
    pass


class Right(Base):
    pass


class Both(Left, Right):
    pass


class BothChild(Both):
    pass


def test_most_specific_match_and_subclasses_inherit():
    reg: TypeRegistry[str] = TypeRegistry("test")
    reg.register(Base)("base")
    assert reg.lookup(Left) == "base"  # inherits
    assert reg.lookup(Left()) == "base"  # instances too
    reg.register(Left)("left")
    assert reg.lookup(Left) == "left"  # the more specific entry wins
    assert reg.lookup(Both) == "left"  # Left is more specific than Base: no ambiguity
    assert reg.lookup(Right) == "base"
    assert reg.match(Both) == (Left, "left")
    assert reg.lookup(int) is None and reg.match(int) is None
    # Gamma's entry serves Chi2 until Chi2 has its own (the lookup cache follows the change)
    reg.register(Gamma)("gamma")
    assert reg.lookup(Chi2(torch.tensor(3.0))) == "gamma"
    reg.register(Chi2)("chi2")
    assert reg.lookup(Chi2(torch.tensor(3.0))) == "chi2"
    assert reg.unregister(Chi2) == "chi2"
    assert reg.lookup(Chi2) == "gamma"


def test_ambiguity_raises_naming_the_registry_type_candidates_and_fix():
    reg: TypeRegistry[str] = TypeRegistry("widget", register_with="mymodule.register_widget")
    reg.register(Left)("left")
    reg.register(Right)("right")
    for query in (Both, Both(), BothChild):
        with pytest.raises(AmbiguousLookupError) as info:
            reg.lookup(query)
        message = str(info.value)
        name = "BothChild" if query is BothChild else "Both"
        assert f"The widget registry cannot choose an entry for {name}" in message
        assert "Left (test_registry)" in message and "Right (test_registry)" in message
        assert f"Register an entry for {name} itself (with mymodule.register_widget)" in message
    assert isinstance(AmbiguousLookupError("x"), LookupError)
    # the fix: register the subclass itself
    reg.register(Both)("both")
    assert reg.lookup(Both) == "both" and reg.lookup(BothChild) == "both"
    assert reg.lookup(Left) == "left" and reg.lookup(Right) == "right"


def test_ambiguity_through_an_inherited_base():
    """A rival is equally specific only if no other candidate is more specific than it."""

    class Other:
        pass

    class Mixed(Left, Other):
        pass

    reg: TypeRegistry[str] = TypeRegistry("test")
    reg.register(Base, Other)("shared")
    with pytest.raises(AmbiguousLookupError, match=r"Base \(test_registry\), .*Other"):
        reg.lookup(Mixed)  # Base (through Left) and Other: unrelated
    reg.register(Right)("right")
    assert reg.lookup(Both) == "right"  # Right, and Base through Left: Right is a subclass of Base
    reg.register(Left)("left")
    # Left, Right and Base: Base drops out (a base of both), Left and Right are equally specific
    with pytest.raises(AmbiguousLookupError, match=r"inherits from 2 registered types .*: Left \(test_registry\), Right \(test_registry\)\."):
        reg.lookup(BothChild)


def test_default_register_with_names_the_registry():
    reg: TypeRegistry[int] = TypeRegistry("test")
    reg.register(Left, Right)(1)
    with pytest.raises(AmbiguousLookupError, match="with the register method of the test registry"):
        reg.lookup(Both)


def test_double_registration_raises_and_replace_works():
    reg: TypeRegistry[str] = TypeRegistry("gadget")
    reg.register(Left)("first")
    with pytest.raises(DuplicateRegistrationError, match=r"Left is already registered in the gadget registry \(to 'first'\). Pass replace=True"):
        reg.register(Left)("second")
    assert reg.lookup(Left) == "first"
    # atomic: a refused call registers none of its types
    with pytest.raises(DuplicateRegistrationError):
        reg.register(Right, Left)("third")
    assert Right not in reg
    with pytest.raises(DuplicateRegistrationError, match="twice in one call"):
        reg.register(Right, Right)("x")

    def fn():
        pass

    reg.register(Right)(fn)
    with pytest.raises(DuplicateRegistrationError, match=r"\(to test_double_registration_raises_and_replace_works.<locals>.fn\)"):
        reg.register(Right)("y")
    assert reg.register(Left, replace=True)("second") == "second"
    assert reg.lookup(Left) == "second"
    assert isinstance(DuplicateRegistrationError("x"), ValueError)


def test_register_as_decorator_and_on_values():
    reg: TypeRegistry[object] = TypeRegistry("test")

    @reg.register(Left, Right)
    def both(x):
        return x + 1

    assert both(1) == 2  # the decorator returns the function unchanged
    assert reg.lookup(Left) is both and reg.lookup(Right) is both
    value = {"not": "a function"}
    assert reg.register(Base)(value) is value


def test_bad_arguments():
    with pytest.raises(TypeError, match="non-empty string"):
        TypeRegistry("")
    reg: TypeRegistry[int] = TypeRegistry("test")
    with pytest.raises(TypeError, match="test registry: register\\(\\) needs at least one type"):
        reg.register()
    with pytest.raises(TypeError, match="register\\(\\) takes types, got 'Left'"):
        reg.register("Left")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="Left has no entry of its own in the test registry"):
        reg.unregister(Left)


def test_container_protocol_and_repr():
    reg: TypeRegistry[int] = TypeRegistry("test")
    reg.register(Right)(1)
    reg.register(Left)(2)
    assert Left in reg and Both not in reg  # exact registrations, not inheritance
    assert list(reg) == [Right, Left] and len(reg) == 2
    assert repr(reg) == "TypeRegistry('test', [Right, Left])"
    for t in reg:  # iterating while unregistering works (iteration is over a copy)
        reg.unregister(t)
    assert len(reg) == 0


# --------------------------------------------------------------------------- the eleven registries
#: (module, registry, its name, the public register function, the built-in types before issue 12's change)
REGISTRIES = [
    ("storch.method.cumulants", "_CUMULANTS", "cumulants", "register_cumulants",
     {Dirac, Exponential, Gamma, Independent, Laplace, Normal}),
    ("storch.method.local_expectation_points", "_COORDINATES", "local-expectation coordinates", "register_coordinates",
     {Bernoulli, Categorical, OneHotCategorical}),
    ("storch.method.straight_through", "_VIEWS", "one-hot view", "register_one_hot_view",
     {Bernoulli, OneHotCategorical}),
    ("storch.method.spsa", "_WRAPPERS", "SPSA wrapper", "register_spsa_wrapper", {Independent, OneHotCategorical}),
    ("storch.method.critic", "_INPUTS", "critic inputs", "register_critic_inputs",
     {Bernoulli, Categorical, OneHotCategorical}),
    ("storch.method.gsb", "_REPRESENTATIONS", "GSB representation", "register_representation", {Beta, Dirichlet}),
    ("storch.method.gsb", "_RULES", "GSB rule", "register_gsb_rule",
     {Bernoulli, Categorical, OneHotCategorical, Poisson}),
    ("storch.distributions.measure_valued", "_DECOMPOSITIONS", "measure-valued decomposition", "register_measure_valued",
     {Bernoulli, Categorical, Exponential, Normal, OneHotCategorical, Poisson}),
    ("storch.distributions.relaxation", "_RELAXATIONS", "relaxation", "register_relaxation",
     {Bernoulli, OneHotCategorical}),
    ("storch.sampling.unordered_set", "_RELAXED_VALUES", "relaxed WOR value", "register_relaxed_wor_value",
     {Bernoulli, OneHotCategorical}),
    ("storch.sampling.swor", "_SUPPORTS", "WOR support", "register_wor_support",
     {Bernoulli, Categorical, OneHotCategorical}),
]

#: the public register functions that are decorators (the others take the value)
DECORATORS = {"register_cumulants", "register_relaxed_wor_value", "register_wor_support"}


def _ids(entry):
    return f"{entry[0]}.{entry[1]}"


@pytest.mark.parametrize("entry", REGISTRIES, ids=_ids)
def test_builtin_entries(entry):
    module, attr, name, register, builtins = entry
    reg = getattr(importlib.import_module(module), attr)
    assert isinstance(reg, TypeRegistry)
    assert reg.name == name
    assert reg.register_with == f"{module}.{register}"
    # test modules may add their own types (tests/test_mvd.py does): compare the library's
    assert {t for t in reg if not t.__module__.startswith("test")} == builtins
    for t in builtins:
        assert reg.lookup(t) is not None


def _register(module, register, dist_type, value, **kwargs):
    fn = getattr(importlib.import_module(module), register)
    if register in DECORATORS:
        return fn(dist_type, **kwargs)(value)
    if register == "register_spsa_wrapper":
        return fn(dist_type, value.inner, value.rebuild, **kwargs)
    return fn(dist_type, value, **kwargs)


@pytest.mark.parametrize("entry", REGISTRIES, ids=_ids)
def test_public_register_function_goes_through_the_registry(entry):
    module, attr, name, register, builtins = entry
    reg = getattr(importlib.import_module(module), attr)

    class Custom(Distribution):
        pass

    builtin = sorted(builtins, key=lambda t: t.__name__)[0]
    original = reg.lookup(builtin)
    try:
        _register(module, register, Custom, original)
        assert reg.lookup(Custom) is not None and Custom in reg
        with pytest.raises(DuplicateRegistrationError, match=f"Custom is already registered in the {name} registry"):
            _register(module, register, Custom, original)
        # overriding a built-in entry must be said
        with pytest.raises(DuplicateRegistrationError, match=f"{builtin.__name__} is already registered"):
            _register(module, register, builtin, original)
        _register(module, register, builtin, original, replace=True)
        assert Custom in reg and builtin in reg

        class Ambiguous(Custom, builtin):
            pass

        with pytest.raises(AmbiguousLookupError, match=f"The {name} registry cannot choose an entry for "
                                                       f"{Ambiguous.__qualname__}.*with {module}.{register}"):
            reg.lookup(Ambiguous)
    finally:
        reg.unregister(Custom)
    assert {t for t in reg if not t.__module__.startswith("test")} == builtins


def test_gsb_rule_against_representation():
    """GSB combines two registries: the more specific entry wins, a rule at the same type, and
    unrelated ones are ambiguous."""
    from storch.method import gsb

    class MyBeta(Beta):
        pass

    rule = gsb._LocalExpectationRule()
    try:
        gsb.register_gsb_rule(Beta, rule)
        assert gsb.gsb_rule_for(MyBeta(torch.tensor(2.0), torch.tensor(3.0))) is rule  # same type: the rule
        gsb.register_representation(MyBeta, gsb._REPRESENTATIONS.lookup(Beta))
        assert gsb.gsb_rule_for(MyBeta(torch.tensor(2.0), torch.tensor(3.0))) is gsb._CUMULANT_RULE
    finally:
        gsb._RULES.unregister(Beta)
        if MyBeta in gsb._REPRESENTATIONS:
            gsb._REPRESENTATIONS.unregister(MyBeta)

    class Odd(Poisson, Beta):
        pass

    with pytest.raises(AmbiguousLookupError, match="GSB rule and representation registry cannot choose an entry for .*Odd"):
        gsb.gsb_rule_for(Odd.__new__(Odd))
    assert gsb.gsb_rule_for(Beta(torch.tensor(2.0), torch.tensor(3.0))) is gsb._CUMULANT_RULE
    assert type(gsb.gsb_rule_for(Poisson(torch.tensor(2.0)))).__name__ == "_FiniteDifferenceRule"


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        # the messages for unsupported distributions are unchanged
        (lambda: __import__("storch.sampling.swor", fromlist=["x"]).wor_support(Normal(0.0, 1.0)), TypeError,
         r"Normal has no registered support \(registered: \['Bernoulli', 'Categorical', 'OneHotCategorical'\]\)"),
        (lambda: __import__("storch.method.cumulants", fromlist=["x"]).cumulants(Beta(1.0, 1.0), 1), ValueError,
         r"No cumulants are registered for Beta; supported: Dirac, Exponential, Gamma, Independent, Laplace, Normal"),
    ],
)
def test_unsupported_messages(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
