"""Go text/template's parser: tokens into a tree per template name, checked as Go checks them.

Parse-time errors are Go's: an undefined variable or function, `{{break}}` outside `{{range}}`, an
unexpected `{{end}}` or `{{else}}`, an unclosed action. Names of templates made by `define` and
`block` are collected beside the main one ("").
"""

from __future__ import annotations

import ast
import re
from collections.abc import Container

from corral.gotemplate import nodes as n
from corral.gotemplate.errors import TemplateError
from corral.gotemplate.lexer import Token, tokens


def parse(source: str, functions: Container[str], name: str = "") -> dict[str, n.ListNode]:
    """The trees of `source`: the main template under `name`, then each `define`d one under its name."""
    return _Parser(source, functions, name).parse()


class _Parser:
    def __init__(self, source: str, functions: Container[str], name: str):
        self.tokens = list(tokens(source, name))
        self.pos = 0
        self.functions = functions
        self.name = name
        self.trees: dict[str, n.ListNode] = {}
        self.vars: list[str] = ["$"]
        self.range_depth = 0

    # --- tokens -------------------------------------------------------------------------
    def peek(self, skip_space: bool = True) -> Token:
        pos = self.pos
        while skip_space and self.tokens[pos].kind == "space":
            pos += 1
        return self.tokens[pos]

    def next(self, skip_space: bool = True) -> Token:
        while skip_space and self.tokens[self.pos].kind == "space":
            self.pos += 1
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def error(self, token: Token, message: str) -> TemplateError:
        return TemplateError(f"template: {self.name}:{token.line}: {message}")

    def expect(self, kind: str, context: str) -> Token:
        token = self.next()
        if token.kind != kind:
            raise self.error(token, f"unexpected {_describe(token)} in {context}")
        return token

    # --- lists and actions --------------------------------------------------------------
    def parse(self) -> dict[str, n.ListNode]:
        root, end = self.item_list(top=True)
        self.trees = {self.name: root, **{k: v for k, v in self.trees.items() if k != self.name}}
        return self.trees

    def item_list(self, top: bool = False) -> tuple[n.ListNode, str]:
        """Nodes up to the `{{end}}` or `{{else}}` closing this list ("eof" at the top), and which one it was."""
        items = n.ListNode()
        while True:
            token = self.next(skip_space=False)
            if token.kind == "eof":
                if top:
                    return items, "eof"
                raise self.error(token, "unexpected EOF")
            if token.kind == "text":
                items.nodes.append(n.TextNode(token.value))
                continue
            keyword = self.peek()
            if keyword.kind == "keyword" and keyword.value in ("end", "else"):
                if top:
                    raise self.error(keyword, f"unexpected {{{{{keyword.value}}}}}")
                self.next()
                return items, keyword.value
            if keyword.kind == "keyword" and keyword.value == "define" and not top:
                raise self.error(keyword, "unexpected <define> in command")
            node = self.action(token)
            if node is not None:
                items.nodes.append(node)

    def action(self, left: Token):
        token = self.peek()
        if token.kind == "keyword":
            handler = {
                "if": self.branch, "range": self.branch, "with": self.branch, "template": self.template,
                "define": self.define, "block": self.block, "break": self.loop_control, "continue": self.loop_control,
            }.get(token.value)  # fmt: skip
            if handler is not None:
                self.next()
                return handler(token)
        pipe = self.pipeline("command", allow_decl=True)
        return n.ActionNode(left.line, pipe)

    def branch(self, keyword: Token) -> n.BranchNode:
        depth = len(self.vars)  # variables declared from here on live until the branch's {{end}}
        pipe = self.pipeline(keyword.value, allow_decl=True, in_range=keyword.value == "range")
        self.range_depth += keyword.value == "range"
        body, end = self.item_list()
        self.range_depth -= keyword.value == "range"
        else_list = None
        if end == "else":
            follow = self.peek()
            if keyword.value in ("if", "with") and follow.kind == "keyword" and follow.value == keyword.value:
                # `{{else if p}}` is an if inside the else that shares the outer {{end}} (`else with` likewise).
                self.next()
                else_list = n.ListNode([self.branch(follow)])
                del self.vars[depth:]
                return n.BranchNode(keyword.value, keyword.line, pipe, body, else_list)
            if follow.kind == "keyword" and follow.value in ("if", "with"):
                # Go reads `{{else if}}` in a range (or `{{else with}}` in an if) as `{{else}}{{if ...}}`.
                first = self.action(follow)
                else_list, end = self.item_list()
                else_list.nodes.insert(0, first)
            else:
                self.expect("right", "else")
                else_list, end = self.item_list()
            if end != "end":
                raise self.error(keyword, "expected end; found {{else}}")
        self.expect("right", "end")
        del self.vars[depth:]
        return n.BranchNode(keyword.value, keyword.line, pipe, body, else_list)

    def loop_control(self, keyword: Token):
        if self.range_depth == 0:
            raise self.error(keyword, f"{{{{{keyword.value}}}}} outside {{{{range}}}}")
        self.expect("right", keyword.value)
        return (n.BreakNode if keyword.value == "break" else n.ContinueNode)(keyword.line)

    def template_name(self, keyword: Token) -> str:
        token = self.next()
        if token.kind not in ("string", "raw"):
            raise self.error(token, f"unexpected {_describe(token)} in {keyword.value} clause")
        return _unquote(token, self)

    def template(self, keyword: Token) -> n.TemplateNode:
        name = self.template_name(keyword)
        pipe = None
        if self.peek().kind != "right":
            pipe = self.pipeline("template clause", allow_decl=False)
        else:
            self.next()
        return n.TemplateNode(keyword.line, name, pipe)

    def define(self, keyword: Token) -> None:
        name = self.template_name(keyword)
        self.expect("right", "define clause")
        saved, self.vars = self.vars, ["$"]
        body, end = self.item_list()
        self.vars = saved
        if end != "end":
            raise self.error(keyword, "unexpected {{else}} in define")
        self.expect("right", "end")
        self.trees[name] = body
        return None

    def block(self, keyword: Token) -> n.TemplateNode:
        name = self.template_name(keyword)
        pipe = self.pipeline("block clause", allow_decl=False)
        saved, self.vars = self.vars, ["$"]
        body, end = self.item_list()
        self.vars = saved
        if end != "end":
            raise self.error(keyword, "unexpected {{else}} in block")
        self.expect("right", "end")
        self.trees[name] = body
        return n.TemplateNode(keyword.line, name, pipe)

    # --- pipelines ------------------------------------------------------------------------
    def pipeline(self, context: str, allow_decl: bool, in_range: bool = False) -> n.PipeNode:
        """A pipeline up to the closing delimiter (or `)`, which the caller consumes)."""
        start = self.peek()
        pipe = n.PipeNode(start.line)
        if allow_decl:
            self.declarations(pipe, in_range)
        while True:
            token = self.peek()
            if token.kind == "right":
                self.next()
                break
            if token.kind == "rparen":
                break
            pipe.cmds.append(self.command(context))
            token = self.peek()
            if token.kind == "pipe":
                self.next()
                if self.peek().kind in ("right", "rparen"):
                    raise self.error(token, "missing command after |")
        if not pipe.cmds:
            raise self.error(start, f"missing value for {context}")
        for cmd in pipe.cmds[1:]:
            if cmd.args and isinstance(cmd.args[0], (n.BoolNode, n.NilNode, n.NumberNode, n.StringNode, n.DotNode)):
                raise self.error(start, "non executable command in pipeline stage 2")
        return pipe

    def declarations(self, pipe: n.PipeNode, in_range: bool) -> None:
        """`$x :=`, `$x =`, and in a range `$i, $v :=`: consumed when present."""
        save = self.pos
        names = []
        while True:
            token = self.next()
            if token.kind != "variable":
                break
            follow = self.next()
            if follow.kind in ("declare", "assign"):
                names.append(token.value)
                pipe.is_assign = follow.kind == "assign"
                if pipe.is_assign:
                    for name in names:
                        if name not in self.vars:
                            raise self.error(token, f"undefined variable {name!r}".replace("'", '"'))
                else:
                    self.vars.extend(names)
                pipe.decl = names
                return
            if follow.kind == "comma" and in_range and len(names) < 1:
                names.append(token.value)
                continue
            break
        self.pos = save

    def command(self, context: str) -> n.CommandNode:
        cmd = n.CommandNode()
        while True:
            token = self.peek()
            if token.kind in ("right", "rparen", "pipe"):
                break
            cmd.args.append(self.operand())
            follow = self.peek(skip_space=False)
            if follow.kind not in ("space", "right", "rparen", "pipe"):
                raise self.error(follow, f"unexpected {_describe(follow)} in operand")
        if not cmd.args:
            raise self.error(self.peek(), f"missing value for {context}")
        if len(cmd.args) == 1 and isinstance(cmd.args[0], n.NilNode):
            raise self.error(self.peek(), "nil is not a command")
        return cmd

    def operand(self):
        node = self.term()
        follow = self.peek(skip_space=False)
        if follow.kind == "field":
            self.next(skip_space=False)
            fields = follow.value[1:].split(".")
            if isinstance(node, n.VariableNode):
                node.idents += fields
            elif isinstance(node, n.FieldNode):
                node.idents += fields
            elif isinstance(node, (n.BoolNode, n.NumberNode, n.StringNode, n.NilNode, n.DotNode)):
                raise self.error(follow, f"unexpected . after term {follow.value!r}")
            else:
                node = n.ChainNode(node, fields)
        return node

    def term(self):
        token = self.next()
        kind = token.kind
        if kind == "identifier":
            if token.value not in self.functions:
                raise self.error(token, f'function "{token.value}" not defined')
            return n.IdentifierNode(token.value)
        if kind == "dot":
            return n.DotNode()
        if kind == "keyword" and token.value == "nil":
            return n.NilNode()
        if kind == "bool":
            return n.BoolNode(token.value == "true")
        if kind == "variable":
            if token.value not in self.vars:
                raise self.error(token, f'undefined variable "{token.value}"')
            return n.VariableNode([token.value])
        if kind == "field":
            return n.FieldNode(token.value[1:].split("."))
        if kind in ("string", "raw"):
            return n.StringNode(_unquote(token, self))
        if kind == "char":
            return n.NumberNode(ord(_unquote(token, self)), token.value)
        if kind == "number":
            return n.NumberNode(_number(token, self), token.value)
        if kind == "lparen":
            pipe = self.pipeline("parenthesized pipeline", allow_decl=False)
            self.expect("rparen", "parenthesized pipeline")
            return pipe
        raise self.error(token, f"unexpected {_describe(token)} in operand")


def _describe(token: Token) -> str:
    if token.kind == "right":
        return "right delimiter"
    if token.kind == "eof":
        return "EOF"
    return f"<{token.value}>"


_GO_ESCAPE = re.compile(r"\\(?:[abfnrtv\\'\"]|x[0-9a-fA-F]{2}|[0-7]{3}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


def _unquote(token: Token, parser: _Parser) -> str:
    """A Go string, raw string or character literal's value."""
    text = token.value
    if token.kind == "raw":
        return text[1:-1].replace("\r", "")
    body = text[1:-1]
    rest = _GO_ESCAPE.sub("", body)
    if "\\" in rest:
        raise parser.error(token, f"bad quoted string {text}")
    try:
        # Go's escapes are Python's, except that \x and octal escapes are bytes: decode them as UTF-8.
        value = ast.literal_eval("b" + text[0] + _to_bytes_literal(body) + text[0]).decode("utf-8")
    except (ValueError, SyntaxError, UnicodeDecodeError):
        raise parser.error(token, f"bad quoted string {text}") from None
    if token.kind == "char" and len(value) != 1:
        raise parser.error(token, f"malformed character constant: {text}")
    return value


def _to_bytes_literal(body: str) -> str:
    r"""The body of a Go literal as a Python bytes literal's: non-ASCII and \u escapes become UTF-8 \x bytes."""
    out = []
    for match in re.finditer(r"\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})|\\.|[^\\]", body):
        piece = match.group()
        code = match.group(1) or match.group(2)
        char = chr(int(code, 16)) if code else (piece if len(piece) == 1 else None)
        if char is None:
            out.append(piece)
        elif char.isascii() and not code:
            out.append(char)
        else:
            out.append("".join(f"\\x{b:02x}" for b in char.encode("utf-8")))
    return "".join(out)


def _number(token: Token, parser: _Parser) -> int | float:
    """A Go number literal: an int when it is one, else a float (imaginary numbers are refused)."""
    text = token.value.replace("_", "")
    if text.endswith("i"):
        raise parser.error(token, f"complex numbers are not supported: {token.value}")
    try:
        if re.fullmatch(r"[+-]?0[0-7]+", text):
            return int(text.replace("0", "0o", 1) if text[0] == "0" else text[0] + "0o" + text[2:], 0)
        if re.fullmatch(r"[+-]?(0[xXbBoO][0-9a-fA-F]+|[0-9]+)", text):
            return int(text, 0)
        if text.lower().lstrip("+-").startswith("0x"):
            return float.fromhex(text)
        return float(text)
    except ValueError:
        raise parser.error(token, f"bad number syntax: {token.value!r}") from None
