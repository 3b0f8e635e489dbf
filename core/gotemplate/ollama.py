"""Ollama's templates: Go text/template with Ollama's functions, data and rendering rules (template/template.go).

* Parsing uses `missingkey=zero` and Ollama's functions (json, currentDate, yesterdayDate,
  toTypeScriptType). A template naming neither `.Messages` nor `.Response` gets `{{ .Response }}`
  appended; `{{template "x"}}` without a pipeline is refused, as Ollama refuses it.
* Rendering collates the messages (consecutive messages of one role but "tool" are joined by a blank
  line; the system messages, joined likewise, are `.System`). A prompt with a suffix renders
  `.Prompt`/`.Suffix`; a template naming `.Messages` renders them (and `.Tools`) at once; any other
  (a "legacy" template of `.System`/`.Prompt`/`.Response`) renders once per user/assistant pair, the
  last pair cut after its `{{ .Response }}`, so the prompt ends where the reply starts.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Sequence
from typing import Any

import attrs

from corral.gotemplate import data, nodes as n
from corral.gotemplate.errors import TemplateError
from corral.gotemplate.execute import execute
from corral.gotemplate.funcs import BUILTINS
from corral.gotemplate.parser import parse
from corral.gotemplate.values import marshal


def _json(value: Any) -> str:
    try:
        return marshal(value)
    except TemplateError:
        return ""  # Ollama's json helper drops the marshalling error and prints nothing


def _date_args(args: tuple) -> None:
    for arg in args:
        if not isinstance(arg, str):
            raise TemplateError("wrong type for value; expected string")


def _current_date(*args: Any) -> str:
    _date_args(args)  # the format argument is accepted and ignored, as in Ollama
    return datetime.date.today().isoformat()


def _yesterday_date(*args: Any) -> str:
    _date_args(args)
    return (datetime.date.today() - datetime.timedelta(days=1)).isoformat()


FUNCTIONS = {
    **BUILTINS,
    "json": _json,
    "currentDate": _current_date,
    "yesterdayDate": _yesterday_date,
    "toTypeScriptType": data.typescript_type,
}


@attrs.frozen
class OllamaTemplate:
    """A parsed Ollama TEMPLATE; `render` gives the prompt Ollama's `Template.Execute` writes."""

    source: str
    trees: dict[str, n.ListNode] = attrs.field(init=False, repr=False, eq=False)
    vars: frozenset[str] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        trees = parse(self.source, FUNCTIONS)
        if not {"messages", "response"} & _names(trees):
            response = n.ActionNode(0, n.PipeNode(0, cmds=[n.CommandNode([n.FieldNode(["Response"])])]))
            trees[""].nodes.append(response)
        object.__setattr__(self, "trees", trees)
        object.__setattr__(self, "vars", _names(trees))

    def render(
        self,
        messages: Sequence[dict] = (),
        tools: list[dict] | None = None,
        prompt: str = "",
        suffix: str = "",
        think: bool = False,
        think_level: str = "",
        is_think_set: bool = False,
    ) -> str:
        """The prompt for API `messages` and `tools` (or a `prompt` with a `suffix`, for fill-in-the-middle)."""
        thinking = {"Think": think, "ThinkLevel": think_level, "IsThinkSet": is_think_set}
        if prompt and suffix:
            return self._run({"Prompt": prompt, "Suffix": suffix, "Response": ""} | thinking)
        system, collated = collate([data.message(m, f"messages[{i}]") for i, m in enumerate(messages)])
        if "messages" in self.vars:
            listed = data.GoSlice(collated)
            listed.nil = not collated
            values = {"System": system, "Messages": listed, "Tools": data.tools(tools), "Response": ""}
            return self._run(values | thinking)
        return self._legacy(collated, thinking)

    def _run(self, values: dict) -> str:
        return execute(self.trees, data.GoMap(values), FUNCTIONS)

    def _legacy(self, messages: list[data.Message], thinking: dict) -> str:
        """One render per system/user/assistant group; the last one stops after `{{ .Response }}`."""
        out: list[str] = []
        turn = {"System": "", "Prompt": "", "Response": ""}

        def flush() -> None:
            out.append(self._run(turn | thinking))
            turn.update(System="", Prompt="", Response="")

        for message in messages:
            if message.Role == "system":
                if turn["Prompt"] or turn["Response"]:
                    flush()
                turn["System"] = message.Content
            elif message.Role == "user":
                if turn["Response"]:
                    flush()
                turn["Prompt"] = message.Content
            elif message.Role == "assistant":
                turn["Response"] = message.Content
        # Ollama runs the cut tree as a new bare template: no helpers, no defines, missing keys give no value.
        cut = {"": cut_after_response(self.trees[""])}
        out.append(execute(cut, data.GoMap(turn | thinking), BUILTINS, missing_zero=False))
        return "".join(out)


def _names(trees: dict[str, n.ListNode]) -> frozenset[str]:
    return frozenset(name.lower() for tree in trees.values() for name in identifiers(tree))


def collate(messages: list[data.Message]) -> tuple[str, list[data.Message]]:
    """Ollama's collate: the system messages joined, and consecutive same-role messages (but tool ones) merged."""
    system, collated = [], []
    for message in messages:
        if message.Role == "system":
            system.append(message.Content)
        if collated and collated[-1].Role == message.Role and message.Role != "tool":
            collated[-1].Content += "\n\n" + message.Content
        else:
            collated.append(message)
    return "\n\n".join(system), collated


def identifiers(node: Any) -> list[str]:
    """The field and variable names a tree uses, as Ollama's `Identifiers` collects them (to choose a mode)."""
    if isinstance(node, n.ListNode):
        return [name for child in node.nodes for name in identifiers(child)]
    if isinstance(node, n.TemplateNode):
        if node.pipe is None:
            raise TemplateError("undefined template specified")
        return identifiers(node.pipe)
    if isinstance(node, n.ActionNode):
        return identifiers(node.pipe)
    if isinstance(node, n.BranchNode):
        names = identifiers(node.pipe) + identifiers(node.list)
        return names + (identifiers(node.else_list) if node.else_list is not None else [])
    if isinstance(node, n.PipeNode):
        return [name for cmd in node.cmds for arg in cmd.args for name in identifiers(arg)]
    if isinstance(node, (n.FieldNode, n.VariableNode)):
        return list(node.idents)
    return []


def cut_after_response(root: n.ListNode) -> n.ListNode:
    """A copy of the tree with every node after the first `.Response` field removed (Ollama's deleteNode).

    The walk visits a node before its children; once the field is seen, each node visited after it is
    dropped. An if/range/with's condition is not visited, and a branch whose else would be dropped is
    a template Ollama itself cannot render.
    """
    cut = False

    def drop(node: Any) -> bool:
        nonlocal cut
        if isinstance(node, n.FieldNode) and "Response" in node.idents:
            cut = True
            return False
        return cut

    def walk(node: Any) -> Any:
        if drop(node):
            return None
        if isinstance(node, n.ListNode):
            node.nodes = [kept for kept in map(walk, node.nodes) if kept is not None]
        elif isinstance(node, n.BranchNode):
            body = walk(node.list)
            else_list = walk(node.else_list) if node.else_list is not None else None
            if body is None or (node.else_list is not None and else_list is None):
                raise TemplateError("this template's {{ .Response }} stands where Ollama cannot cut the template after it")
            node.list, node.else_list = body, else_list
        elif isinstance(node, n.ActionNode):
            node.pipe = walk(node.pipe)
            if node.pipe is None:
                return None
        elif isinstance(node, n.PipeNode):
            commands = []
            for cmd in node.cmds:
                args = [kept for kept in map(walk, cmd.args) if kept is not None]
                if not args:
                    return None
                cmd.args = args
                commands.append(cmd)
            if not commands:
                return None
            node.cmds = commands
        return node

    return walk(copy.deepcopy(root))
