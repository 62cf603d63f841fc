"""Graph passes of `storch.compile_step`: the traced graph simplified before it is replayed.

torch's own passes do the general work: `torch.fx.passes.dialect.common.cse_pass.CSEPass` merges
repeated computations (a ``log_prob`` that the step and an estimator both compute) and
`torch.fx.Graph.eliminate_dead_code` drops what nothing uses. Both are written for functional
graphs; a traced training step is not one (buffers, optimizer state and fresh tensors are updated in
place), so storch adds the rules they lack:

* `unmergeable_ops`: the operations CSE must keep apart in this graph: updates in place, random
  draws, assertions, factories, and every operation that reads or makes a tensor updated in place
  somewhere in the graph (two reads of a buffer around its update are two values);
* `remove_identities`: ``detach``, ``alias`` and views to the same shape and strides only rename a
  tensor in a replay (it runs without autograd); torch has no public pass for this on an aten graph;
* profiler ranges (``record_function``, opened by an optimizer's ``step``) count as dead code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.passes.dialect.common.cse_pass import CSEPass

__all__ = [
    "is_mutation", "is_profiler_range", "is_view", "merge_repeated", "remove_dead_code",
    "remove_identities", "simplify", "unmergeable_ops", "written_arguments",
]

_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default}  # without autograd these only rename a tensor
_SAME_SHAPE_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
                     _aten.expand.default, _aten.permute.default}


# ---------------------------------------------------------------------- what a node does
def _schema(node: torch.fx.Node) -> Any:
    """The aten schema of ``node``'s operation, or ``None`` for other targets (``operator.getitem``)."""
    return node.target._schema if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) else None


def is_mutation(node: torch.fx.Node) -> bool:
    """An operation that writes into one of its arguments (``add_``, ``copy_``, ``_foreach_add_``)."""
    schema = _schema(node)
    return schema is not None and schema.is_mutable


def is_view(node: torch.fx.Node) -> bool:
    """An operation that returns a view of an argument without writing (``view``, ``expand``, ...)."""
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable
            and any(r.alias_info is not None for r in schema.returns))


def is_profiler_range(node: torch.fx.Node) -> bool:
    """``record_function``'s entry and exit (an optimizer's ``step`` opens one): nothing to replay."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "profiler"


def written_arguments(node: torch.fx.Node) -> list[Any]:
    """The arguments an operation writes into (``add_``'s self, ``copy_``'s destination, ``out=``)."""
    written: list[Any] = []
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            written.extend(value if isinstance(value, (list, tuple)) else [value])  # _foreach_add_'s lists
    return written


def _shape_and_stride(node: Any) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return (tuple(value.shape), value.stride()) if isinstance(value, torch.Tensor) else None


def _is_identity(node: torch.fx.Node) -> bool:
    """A node whose result is its first argument under another name (a replay needs no autograd)."""
    if node.target in _ALIASES:
        return True
    if node.target not in _SAME_SHAPE_VIEWS:
        return False
    if node.target is _aten.permute.default and list(node.args[1]) != list(range(len(node.args[1]))):
        return False
    meta = _shape_and_stride(node)
    return meta is not None and meta == _shape_and_stride(node.args[0])


# ---------------------------------------------------------------------- the passes
def remove_identities(graph: torch.fx.Graph) -> None:
    """Replace each renaming node (`_is_identity`) by its argument."""
    for node in list(graph.nodes):
        if node.op == "call_function" and _is_identity(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _storage_roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """For each node, the node whose tensor it views (itself for a fresh tensor)."""
    roots: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        aliases = is_view(node) or (is_mutation(node) and node.users)  # add_ returns its self
        roots[node] = roots.get(source, source) if aliases and source is not None else node
    return roots


def _op_of(node: torch.fx.Node) -> Any:
    """What `CSEPass` bans by: the overload packet (``aten.mul``), or the target itself."""
    return getattr(node.target, "overloadpacket", node.target)


def unmergeable_ops(graph: torch.fx.Graph) -> set[Any]:
    """The operations (overload packets) that CSE may not merge in this graph.

    `CSEPass` decides by operation, not by node, so an operation is banned as a whole when any of its
    nodes is unsafe to merge: an update in place, a random draw (``nondeterministic_seeded``), an
    assertion or profiler range, a factory (no tensor input), and a node that reads, views or makes a
    tensor that some operation of the graph updates in place. The last rule keeps a value computed
    before and after an update of a buffer apart, and two equal fresh tensors that are then written
    differently. Banning less would need a pass that knows the order of mutations; banning by
    operation only loses merges in graphs with updates in place, never correctness.
    """
    roots = _storage_roots(graph)
    written = {roots[t] for node in graph.nodes if is_mutation(node)
               for t in written_arguments(node) if isinstance(t, torch.fx.Node)}
    banned: set[Any] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        schema = _schema(node)
        unsafe = (
            is_mutation(node) or is_profiler_range(node) or not node.all_input_nodes
            or (schema is not None and (torch.Tag.nondeterministic_seeded in node.target.tags
                                        or schema.name.startswith("aten::_assert")))
            or roots[node] in written or any(roots[source] in written for source in node.all_input_nodes)
        )
        if unsafe:
            banned.add(_op_of(node))
    return banned


def merge_repeated(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Merge repeated computations with torch's `CSEPass` (a new module when it merged any).

    The pass builds a new graph with torch's default code generation; it gets back the one of
    ``make_fx``'s graph, whose ``forward`` takes and returns the step's structures (lists of inputs,
    a `storch._compile.trace.StepOutputs`).
    """
    merged = CSEPass(banned_ops=unmergeable_ops(module.graph))(module).graph_module
    if merged is not module:
        merged.graph.set_codegen(module.graph._codegen)
    return merged


def remove_dead_code(graph: torch.fx.Graph) -> None:
    """torch's dead-code elimination, which keeps updates in place, assertions and random draws;
    profiler ranges count as pure here, so that the unused ones go too."""
    graph.eliminate_dead_code(is_impure_node=lambda node: not is_profiler_range(node) and node.is_impure())


def simplify(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The traced graph as replayed: renaming nodes, repeated computations and dead code removed."""
    remove_identities(module.graph)
    module = merge_repeated(module)
    remove_dead_code(module.graph)
    module.recompile()
    return module
