"""The parse tree of a Go template, as text/template/parse builds it."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class ListNode:
    nodes: list[Any] = attrs.field(factory=list)


@attrs.define
class TextNode:
    text: str


@attrs.define
class PipeNode:
    """`$x := cmd | cmd`: declared (or assigned) variables and the commands piped left to right."""

    line: int
    decl: list[str] = attrs.field(factory=list)
    is_assign: bool = False
    cmds: list[CommandNode] = attrs.field(factory=list)


@attrs.define
class CommandNode:
    args: list[Any] = attrs.field(factory=list)


@attrs.define
class ActionNode:
    line: int
    pipe: PipeNode


@attrs.define
class BranchNode:
    """if, range or with: the pipeline, the body and the optional else."""

    kind: str
    line: int
    pipe: PipeNode
    list: ListNode
    else_list: ListNode | None = None


@attrs.define
class TemplateNode:
    line: int
    name: str
    pipe: PipeNode | None = None


@attrs.define
class BreakNode:
    line: int


@attrs.define
class ContinueNode:
    line: int


@attrs.define
class FieldNode:
    idents: list[str]


@attrs.define
class VariableNode:
    idents: list[str]  # the variable's name ("$x", "$") and the fields after it


@attrs.define
class ChainNode:
    """`(pipeline).Field.Other`: fields of a parenthesized pipeline's value."""

    node: Any
    fields: list[str]


@attrs.define
class IdentifierNode:
    name: str  # a function


@attrs.define
class DotNode:
    pass


@attrs.define
class NilNode:
    pass


@attrs.define
class BoolNode:
    value: bool


@attrs.define
class NumberNode:
    value: int | float
    text: str


@attrs.define
class StringNode:
    value: str
