"""Running a parsed Go template over data, as text/template's exec.go does.

Data follows `values`' conventions. Options as Go's: `missing_zero` is `missingkey=zero` (a missing
map key gives nil), otherwise a missing key gives no value (`<no value>` when printed) and fields of
no value are no value too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from corral.gotemplate import nodes as n
from corral.gotemplate.errors import TemplateError
from corral.gotemplate.funcs import ARITY
from corral.gotemplate.values import NO_VALUE, GoStruct, sprint, truth, type_name

_MISSING = object()  # no final value piped into a command
_MAX_DEPTH = 100  # nested {{template}} calls, as Go's maxExecDepth guards against runaway recursion


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def execute(
    trees: Mapping[str, n.ListNode],
    data: Any,
    functions: Mapping[str, Callable[..., Any]],
    missing_zero: bool = True,
    name: str = "",
) -> str:
    """The text of template `name` of `trees` run over `data`."""
    state = _State(trees, functions, missing_zero, name)
    state.vars = [("$", data)]
    state.walk(data, trees[name])
    return "".join(state.out)


class _State:
    def __init__(self, trees, functions, missing_zero, name, depth=0):
        self.trees = trees
        self.functions = functions
        self.missing_zero = missing_zero
        self.name = name
        self.depth = depth
        self.out: list[str] = []
        self.vars: list[tuple[str, Any]] = []
        self.line = 0

    def error(self, message: str) -> TemplateError:
        return TemplateError(f"template: {self.name}:{self.line}: executing: {message}")

    # --- variables ---------------------------------------------------------------------------
    def set_var(self, name: str, value: Any) -> None:
        for i in range(len(self.vars) - 1, -1, -1):
            if self.vars[i][0] == name:
                self.vars[i] = (name, value)
                return
        raise self.error(f"undefined variable: {name}")

    def var(self, name: str) -> Any:
        for var_name, value in reversed(self.vars):
            if var_name == name:
                return value
        raise self.error(f"undefined variable: {name}")

    # --- walking -------------------------------------------------------------------------------
    def walk(self, dot: Any, node: Any) -> None:
        if isinstance(node, n.ListNode):
            for child in node.nodes:
                self.walk(dot, child)
        elif isinstance(node, n.TextNode):
            self.out.append(node.text)
        elif isinstance(node, n.ActionNode):
            self.line = node.line
            value = self.pipeline(dot, node.pipe)
            if not node.pipe.decl:
                self.out.append(self.printable(value))
        elif isinstance(node, n.BranchNode):
            self.line = node.line
            mark = len(self.vars)
            if node.kind == "range":
                self.walk_range(dot, node)
            else:
                value = self.pipeline(dot, node.pipe)
                if truth(value):
                    self.walk(value if node.kind == "with" else dot, node.list)
                elif node.else_list is not None:
                    self.walk(dot, node.else_list)
            del self.vars[mark:]
        elif isinstance(node, n.TemplateNode):
            self.walk_template(dot, node)
        elif isinstance(node, n.BreakNode):
            raise _Break
        elif isinstance(node, n.ContinueNode):
            raise _Continue
        else:
            raise self.error(f"unknown node: {node!r}")

    def printable(self, value: Any) -> str:
        if value is None or value is NO_VALUE:
            return "<no value>"
        try:
            return sprint(value)
        except TemplateError as error:
            raise self.error(str(error)) from None

    def walk_range(self, dot: Any, node: n.BranchNode) -> None:
        value = self.pipeline(dot, node.pipe)
        if value is None or value is NO_VALUE:
            items = []
        elif isinstance(value, dict):
            items = sorted(value.items(), key=lambda item: (str(type(item[0])), item[0]))
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            if len(node.pipe.decl) > 1:
                raise self.error(f"can't use {value} to iterate over more than one variable")
            items = [(i, i) for i in range(value)]
        else:
            raise self.error(f"range can't iterate over {self.printable(value)}")
        if not items:
            if node.else_list is not None:
                self.walk(dot, node.else_list)
            return
        decl = node.pipe.decl
        for key, element in items:
            if decl:
                if node.pipe.is_assign:
                    self.set_var(decl[0], key if len(decl) > 1 else element)
                    if len(decl) > 1:
                        self.set_var(decl[1], element)
                else:
                    # The pipeline pushed its variables; the last one is the element, the first the key.
                    self.vars[-1] = (self.vars[-1][0], element)
                    if len(decl) > 1:
                        self.vars[-2] = (self.vars[-2][0], key)
            mark = len(self.vars)
            try:
                self.walk(element, node.list)
            except _Continue:
                pass
            except _Break:
                break
            finally:
                del self.vars[mark:]

    def walk_template(self, dot: Any, node: n.TemplateNode) -> None:
        self.line = node.line
        tree = self.trees.get(node.name)
        if tree is None:
            raise self.error(f'template: no template "{node.name}" associated with template "{self.name}"')
        if self.depth >= _MAX_DEPTH:
            raise self.error(f"exceeded maximum template depth ({_MAX_DEPTH})")
        value = self.pipeline(dot, node.pipe) if node.pipe is not None else None
        inner = _State(self.trees, self.functions, self.missing_zero, node.name, self.depth + 1)
        inner.vars = [("$", value)]
        inner.walk(value, tree)
        self.out.extend(inner.out)

    # --- pipelines and commands ------------------------------------------------------------------
    def pipeline(self, dot: Any, pipe: n.PipeNode) -> Any:
        value = _MISSING
        for cmd in pipe.cmds:
            value = self.command(dot, cmd, value)
        for name in pipe.decl:
            if pipe.is_assign:
                self.set_var(name, value)
            else:
                self.vars.append((name, value))
        return value

    def command(self, dot: Any, cmd: n.CommandNode, final: Any) -> Any:
        first = cmd.args[0]
        if isinstance(first, n.FieldNode):
            return self.field_chain(dot, dot, first.idents, cmd.args, final)
        if isinstance(first, n.ChainNode):
            return self.chain(dot, first, cmd.args, final)
        if isinstance(first, n.VariableNode):
            return self.variable(dot, first, cmd.args, final)
        if isinstance(first, n.IdentifierNode):
            return self.call(dot, first.name, cmd.args[1:], final)
        if len(cmd.args) > 1 or final is not _MISSING:
            raise self.error(f"can't give argument to non-function {_show(first)}")
        if isinstance(first, n.PipeNode):
            mark = len(self.vars)
            value = self.pipeline(dot, first)
            del self.vars[mark:]
            return value
        return self.constant(dot, first)

    def constant(self, dot: Any, node: Any) -> Any:
        if isinstance(node, n.DotNode):
            return dot
        if isinstance(node, (n.BoolNode, n.NumberNode, n.StringNode)):
            return node.value
        if isinstance(node, n.NilNode):
            raise self.error("nil is not a command")
        raise self.error(f"can't evaluate command {node!r}")

    def argument(self, dot: Any, node: Any) -> Any:
        """An operand's value as a function argument."""
        if isinstance(node, n.NilNode):
            return None
        if isinstance(node, n.FieldNode):
            return self.field_chain(dot, dot, node.idents, [node], _MISSING)
        if isinstance(node, n.VariableNode):
            return self.variable(dot, node, [node], _MISSING)
        if isinstance(node, n.ChainNode):
            return self.chain(dot, node, [node], _MISSING)
        if isinstance(node, n.IdentifierNode):
            return self.call(dot, node.name, [], _MISSING)
        if isinstance(node, n.PipeNode):
            mark = len(self.vars)
            value = self.pipeline(dot, node)
            del self.vars[mark:]
            return value
        return self.constant(dot, node)

    def variable(self, dot: Any, node: n.VariableNode, args: list, final: Any) -> Any:
        value = self.var(node.idents[0])
        if len(node.idents) == 1:
            if len(args) > 1 or final is not _MISSING:
                raise self.error(f"can't give argument to non-function {node.idents[0]}")
            return value
        return self.field_chain(dot, value, node.idents[1:], args, final)

    def chain(self, dot: Any, node: n.ChainNode, args: list, final: Any) -> Any:
        value = self.argument(dot, node.node)
        return self.field_chain(dot, value, node.fields, args, final)

    def field_chain(self, dot: Any, receiver: Any, idents: list[str], args: list, final: Any) -> Any:
        for ident in idents[:-1]:
            receiver = self.field(receiver, ident, has_args=False)
        return self.field(receiver, idents[-1], has_args=len(args) > 1 or final is not _MISSING)

    def field(self, receiver: Any, name: str, has_args: bool) -> Any:
        """Field `name` of a struct, or key `name` of a map (missingkey decides a missing one)."""
        if receiver is NO_VALUE:
            return NO_VALUE
        if receiver is None:
            raise self.error(f"nil pointer evaluating interface {{}}.{name}")
        if isinstance(receiver, GoStruct):
            if name not in _field_names(type(receiver)):
                raise self.error(f"can't evaluate field {name} in type {type_name(receiver)}")
            if has_args:
                raise self.error(f"{name} has arguments but cannot be invoked as function")
            return getattr(receiver, name)
        if isinstance(receiver, dict):
            if has_args:
                raise self.error(f"{name} is not a method but has arguments")
            if name in receiver:
                return receiver[name]
            if not self.missing_zero:
                return NO_VALUE
            zero = getattr(receiver, "zero", None)
            return zero() if zero else None
        raise self.error(f"can't evaluate field {name} in type {type_name(receiver)}")

    def call(self, dot: Any, name: str, arg_nodes: list, final: Any) -> Any:
        function = self.functions.get(name)
        if function is None:
            raise self.error(f'"{name}" is not a defined function')
        count = len(arg_nodes) + (final is not _MISSING)
        required, variadic = ARITY.get(name, (0, True))
        if count < required or (not variadic and count != required):
            want = f"at least {required}" if variadic else str(required)
            raise self.error(f"wrong number of args for {name}: want {want} got {count}")
        if name in ("and", "or"):
            return self.logical(dot, name, arg_nodes, final)
        args = [self.argument(dot, node) for node in arg_nodes]
        if final is not _MISSING:
            args.append(final)
        try:
            return function(*args)
        except TemplateError as error:
            raise self.error(str(error)) from None
        except TypeError as error:
            raise self.error(f"error calling {name}: {error}") from None

    def logical(self, dot: Any, name: str, arg_nodes: list, final: Any) -> Any:
        """and / or: the first false (true) argument, else the last, evaluating no further than needed."""
        thunks = [lambda node=node: self.argument(dot, node) for node in arg_nodes]
        if final is not _MISSING:
            thunks.append(lambda: final)
        value = None
        for thunk in thunks:
            value = thunk()
            if truth(value) == (name == "or"):
                return value
        return value


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(field.name for field in attrs.fields(cls))


def _show(node: Any) -> str:
    if isinstance(node, n.StringNode):
        return f'"{node.value}"'
    if isinstance(node, (n.NumberNode,)):
        return node.text
    if isinstance(node, n.BoolNode):
        return "true" if node.value else "false"
    if isinstance(node, n.DotNode):
        return "."
    return "pipeline"
