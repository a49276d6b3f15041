"""Check an SGLang source tree for the names in compat.REQUIREMENTS, by parsing, not importing.

Importing SGLang needs CUDA libraries and gigabytes of wheels; parsing its files needs
neither, so the check runs on any CPU host against the wheel's files.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator

from hsq.engines.sglang.compat import Requirement, Symbol, requirements_for

SourceReader = Callable[[str], str | None]
"""Returns the text of a file in the source tree ("sglang/srt/x.py"), or None if absent."""

_Def = ast.FunctionDef | ast.AsyncFunctionDef


def _walk_defs(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Top-level statements, looking inside if/try blocks (conditional definitions)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _walk_defs(node.body)
            yield from _walk_defs(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _walk_defs(block)
            for handler in node.handlers:
                yield from _walk_defs(handler.body)
        else:
            yield node


def _named(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    return [
        n
        for n in _walk_defs(body)
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    ]


def _params(fn: _Def) -> list[str]:
    return [a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]]


def _calls(fn: _Def) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                out.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                out.add(node.func.attr)
    return out


def _check_def(fn: _Def, sym: Symbol) -> str | None:
    params = _params(fn)
    if params[: len(sym.params)] != list(sym.params):
        return f"{sym.target} has parameters {params}, the hook needs {list(sym.params)} first"
    missing = [c for c in sym.calls if c not in _calls(fn)]
    if missing:
        return f"{sym.target} no longer calls {missing}"
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign):
        return [node.target]
    return []


def _class_has_attr(cls: ast.ClassDef, name: str) -> bool:
    # Class-level fields: dataclass/msgspec annotations and enum members.
    for stmt in cls.body:
        if any(isinstance(t, ast.Name) and t.id == name for t in _targets(stmt)):
            return True
    # Instance attributes: `self.<name> = ...` anywhere in the class's methods.
    for node in ast.walk(cls):
        for t in _targets(node):
            if (
                isinstance(t, ast.Attribute)
                and t.attr == name
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                return True
    return False


def find(tree: ast.Module, text: str, sym: Symbol) -> str | None:
    """None when ``sym`` is in this module's source, else what is wrong."""
    if sym.kind == "text":
        return None if sym.qualname in text else f"{sym.qualname!r} not in {sym.module}"
    *owners, name = sym.qualname.split(".")
    body: list[ast.stmt] = tree.body
    classes: list[ast.ClassDef] = []
    for owner in owners:
        classes = [n for n in _named(body, owner) if isinstance(n, ast.ClassDef)]
        if not classes:
            return f"class {owner} not in {sym.module}"
        body = [stmt for c in classes for stmt in c.body]
    if sym.kind == "attr":
        if any(_class_has_attr(c, name) for c in classes):
            return None
        return f"{sym.target} (attribute) not found"
    nodes = _named(body, name)
    if sym.kind == "class":
        return None if any(isinstance(n, ast.ClassDef) for n in nodes) else f"{sym.target} missing"
    fns = [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    if not fns:
        return f"{sym.target} (function) not found"
    problems = [_check_def(fn, sym) for fn in fns]
    return None if None in problems else problems[0]


class SourceTree:
    """Parsed modules of one SGLang version, parsed once each."""

    def __init__(self, read: SourceReader) -> None:
        self._read = read
        self._cache: dict[str, tuple[ast.Module, str] | None] = {}

    def module(self, sym: Symbol) -> tuple[ast.Module, str] | None:
        if sym.module not in self._cache:
            parsed = None
            for path in sym.paths:
                text = self._read(path)
                if text is not None:
                    parsed = (ast.parse(text, filename=path), text)
                    break
            self._cache[sym.module] = parsed
        return self._cache[sym.module]

    def problem(self, sym: Symbol) -> str | None:
        mod = self.module(sym)
        if mod is None:
            return f"module {sym.module} not found"
        return find(mod[0], mod[1], sym)

    def unmet(self, req: Requirement) -> str | None:
        problems = [self.problem(s) for s in req.alternatives]
        if None in problems:
            return None
        return f"{req.why}: " + "; ".join(p for p in problems if p)


def check(read: SourceReader, version: str) -> list[str]:
    """Every requirement of ``version`` that its source does not meet (empty: all met)."""
    tree = SourceTree(read)
    return [msg for req in requirements_for(version) if (msg := tree.unmet(req)) is not None]
