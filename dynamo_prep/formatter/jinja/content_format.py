"""A chat template's content format, detected from its Jinja AST as vLLM 0.32 detects it.

``"openai"`` when the template loops over a message's content: ``for x in m.content`` (filters,
tests and slices around it allowed) where ``m`` is the variable of a loop over ``messages`` or over
a name assigned from it, a loop over a macro parameter that some call passes ``m.content``, or a
loop over a name ``content`` outside any macro. Else ``"string"``; a loop or assignment that vLLM's
walk cannot name (a tuple target) on the way to the answer also gives ``"string"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2
from jinja2 import nodes

__all__ = ["ContentFormat", "detect_content_format", "knows_developer_role"]

ContentFormat = Literal["string", "openai"]


class _UnnamedError(Exception):
    """A target vLLM's walk expects to be a plain name is not one (its detection then says "string")."""


@lru_cache(maxsize=64)
def detect_content_format(environment: jinja2.Environment, source: str) -> ContentFormat:
    """The template's content format ("string" when it cannot be parsed), parsed by ``environment``."""
    try:
        root = environment.parse(source)
        return "openai" if _loops_over_content(root) else "string"
    except (_UnnamedError, jinja2.TemplateError, RecursionError):
        return "string"


def knows_developer_role(source: str) -> bool:
    """vLLM's test: the template names ``"developer"`` or ``'developer'`` somewhere."""
    return '"developer"' in source or "'developer'" in source


def _read(node: nodes.Node) -> str | None:
    """The name ``node`` reads, through filters, tests and slices."""
    return _name(_unwrapped(node))


def _content_read(node: nodes.Node) -> str | None:
    """The name whose ``content`` (``.content`` or ``['content']``) ``node`` reads, through filters,
    tests and slices."""
    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr) and node.attr == "content":
        return _name(node.node)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content":
        return _name(node.node)
    return None


def _name(node: nodes.Node) -> str | None:
    return node.name if isinstance(node, nodes.Name) and node.ctx == "load" else None


def _unwrapped(node: nodes.Node) -> nodes.Node:
    """``node`` without the filters, tests and slices around it (a filter block's filter wraps nothing)."""
    while isinstance(node, nodes.Filter | nodes.Test) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        if node.node is None:
            break
        node = node.node
    return node


def _target(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _UnnamedError
    return node.name


def _aliases(root: nodes.Template, name: str) -> set[str]:
    """``name`` and every name assigned from it, transitively."""
    assigned: dict[str, list[nodes.Assign]] = {}
    for assign in root.find_all(nodes.Assign):
        if (source := _read(assign.node)) is not None:
            assigned.setdefault(source, []).append(assign)
    found, todo = {name}, [name]
    while todo:  # each name once: a cycle of assignments ends
        for assign in assigned.get(todo.pop(), ()):
            if (alias := _target(assign.target)) not in found:
                found.add(alias)
                todo.append(alias)
    return found


def _message_names(root: nodes.Template) -> set[str]:
    """The targets of loops over ``messages`` or its aliases."""
    lists = _aliases(root, "messages")
    return {_target(loop.target) for loop in root.find_all(nodes.For) if _read(loop.iter) in lists}


def _content_params(root: nodes.Template, messages: set[str]) -> tuple[dict[int, set[str]], set[int]]:
    """Per loop inside a macro (by id), the macro's parameters some call passes ``m.content``; and the
    ids of all loops inside macros."""
    calls: dict[str, list[nodes.Call]] = {}
    for call in root.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name):
            calls.setdefault(call.node.name, []).append(call)
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = _params_given_content(calls.get(macro.name, []), macro, messages)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                by_loop[id(loop)] = params
    return by_loop, in_macros


def _params_given_content(calls: list[nodes.Call], macro: nodes.Macro, messages: set[str]) -> set[str]:
    names = [arg.name for arg in macro.args]
    given: set[str] = set()
    for call in calls:
        given.update(
            name for name, arg in zip(names, call.args, strict=False) if _content_read(arg) in messages
        )
        given.update(kw.key for kw in call.kwargs if kw.key in names and _content_read(kw.value) in messages)
    return given


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_names(root)
    by_loop, in_macros = _content_params(root, messages)
    for loop in root.find_all(nodes.For):
        if _content_read(loop.iter) in messages or _is_content_name(
            loop, by_loop.get(id(loop), set()), in_macro=id(loop) in in_macros
        ):
            yield loop


def _is_content_name(loop: nodes.For, params: set[str], *, in_macro: bool) -> bool:
    """The loop iterates a macro parameter given ``m.content``, or a name ``content`` outside macros."""
    name = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
    return name is not None and (name in params or (not in_macro and name == "content"))


def _loops_over_content(root: nodes.Template) -> bool:
    first = next(_content_loops(root), None)
    if first is None:
        return False
    _target(first.target)
    return True
