"""The package's layering: a method states its hooks and never reaches into the round driver that
calls them. Read from the source (the imports as written), so no import order can hide a breach."""

import ast
from pathlib import Path

import pytest

import fl_lightning

PACKAGE = Path(fl_lightning.__file__).parent
ROUND_DRIVER = "fl_lightning.federation"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (also inside functions), as dotted names; a
    `from package import name` counts as importing `package.name` too (it may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_imported_modules_sees_every_form_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import fl_lightning.federation as f\nfrom fl_lightning import federation\n"
                      "def g():\n    from fl_lightning.federation import federation_of\n")
    assert ROUND_DRIVER in imported_modules(source)
    for line in ("from fl_lightning import federation", "def g():\n    import fl_lightning.federation"):
        source.write_text(line + "\n")
        assert ROUND_DRIVER in imported_modules(source), line
    source.write_text("from fl_lightning import round_metrics\nfrom fl_lightning.uploads import ClientUpload\n")
    assert ROUND_DRIVER not in imported_modules(source)


def test_no_method_module_imports_the_round_driver():
    """The round callback (`federation.py`) calls the methods' hooks; a method that imported it
    would depend on the driver it is driven by (what a method logs goes through `round_metrics`)."""
    modules = sorted((PACKAGE / "methods").rglob("*.py"))
    assert len(modules) > 30  # the whole package is read, not an empty glob
    offenders = [str(p.relative_to(PACKAGE)) for p in modules
                 if any(m == ROUND_DRIVER or m.startswith(ROUND_DRIVER + ".") for m in imported_modules(p))]
    assert offenders == []


def test_importing_the_methods_does_not_load_the_round_driver():
    """Nor indirectly: every method module imported, `fl_lightning.federation` is still not loaded."""
    import subprocess
    import sys

    code = ("import sys, fl_lightning.methods; "
            f"print(sorted(m for m in sys.modules if m == {ROUND_DRIVER!r} or m.startswith({ROUND_DRIVER + '.'!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# the hooks each tier of base.py's contract names, and the methods its docstring gives as examples
TIERS = {
    "Tier 1": (("loss",), ("FedProx", "FedNTD")),
    "Tier 2": (("minibatch_step",), ("FedSAM", "FedSOL", "Ditto", "PerFedAvg")),
    "Tier 3": (("client_start", "client_end", "server_step"), ("SCAFFOLD", "FedDyn", "MOON", "FedNova")),
}


def test_the_contracts_examples_override_their_tiers_hooks():
    """The contract's examples are real: each tier's first example overrides every hook the tier
    names, the others at least one, in their own class body (not inherited)."""
    from fl_lightning import methods
    from fl_lightning.methods import base

    doc = base.__doc__
    for tier, (hooks, examples) in TIERS.items():
        assert tier in doc and all(f"`{h}(" in doc for h in hooks), tier
        assert f"Example: {examples[0]} (" in doc, tier
        for i, name in enumerate(examples):
            assert name.replace("PerFedAvg", "Per-FedAvg") in doc, name
            own = set(vars(getattr(methods, name))) & set(hooks)
            assert own == set(hooks) if i == 0 else own, (tier, name, own)


def test_callbacks_that_read_the_round_report_must_come_after_the_round_callback(tmp_path):
    """The results and analysis callbacks read, in the same hooks, what the round callback
    decided: placed before it they would read the previous round's report; refused at fit start."""
    from types import SimpleNamespace

    from fl_lightning.analysis.callback import AnalysisCallback
    from fl_lightning.federation import FederatedCallback
    from fl_lightning.results import ResultsCallback

    for late in (ResultsCallback(tmp_path), AnalysisCallback()):
        trainer = SimpleNamespace(callbacks=[late, FederatedCallback()], is_global_zero=False)
        with pytest.raises(RuntimeError, match=f"{type(late).__name__} must come after FederatedCallback"):
            late.on_fit_start(trainer, None)


def test_accuracy_is_counted_in_one_place():
    """Every accuracy counts `evaluation.correct_predictions` (one NaN policy): no module but
    evaluation.py compares an argmax with labels itself."""
    import re

    pattern = re.compile(r"argmax\((dim=)?(1|-1)\)\s*==")
    offenders = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
                 if path.name != "evaluation.py" and pattern.search(path.read_text())]
    assert offenders == []
# ---- library internals only in compat.py ----------------------------------------------------------
# Names starting with "_" that the libraries document as public API (os._exit: "exit the process
# with status n, without calling cleanup handlers"; Enum's sunder hooks and namedtuple's methods).
DOCUMENTED_UNDERSCORE_NAMES = {"_exit", "_missing_", "_generate_next_value_", "_value_", "_name_", "_ignore_",
                               "_order_", "_replace", "_asdict", "_fields", "_make", "_field_defaults"}
COMPAT = PACKAGE / "compat.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str | None) -> bool:
    return (module or "").split(".")[0] == "fl_lightning"


def _library_bindings(tree: ast.Module) -> set[str]:
    """The names a file binds to another library's modules or objects by importing them."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names if not _ours(a.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not _ours(node.module):
            bound.update(a.asname or a.name for a in node.names)
    return bound


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _attribute_uses(tree: ast.AST):
    """(node, object, name) of every attribute read, written or deleted, also through getattr,
    setattr, hasattr and delattr with a constant name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node, node.args[0], node.args[1].value


def _is_self(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _library_private_names(cls: type) -> set[str]:
    """The private names of `cls`'s bases from other libraries: class attributes, and the instance
    attributes their source assigns (`self._x = ...`)."""
    import inspect
    import textwrap

    names = set()
    for base in cls.__mro__:
        if base is object or base.__module__.startswith("fl_lightning"):
            continue
        names.update(n for n in vars(base) if _private(n))
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and _is_self(node.value) and _private(node.attr):
                names.add(node.attr)
    return names


def _module_of(path: Path):
    import importlib
    import importlib.util

    if path.is_relative_to(PACKAGE):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        return importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shown(path: Path) -> Path:
    return path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else Path(path.name)


def _class_scopes(path: Path, tree: ast.Module):
    """(class node, the library's private names that class inherits) of every class in `path`."""
    module = _module_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            cls = getattr(module, node.name, None)
            inherited = _library_private_names(cls) if isinstance(cls, type) else set()
            yield node, inherited


def _declared_by_compat(node: ast.AST) -> bool:
    """An override of a library's internal method declared through a compat.py decorator (which
    checks, and tests/test_compat.py tests, that the library still has and calls it)."""
    return any(isinstance(d, ast.Call | ast.Attribute) and isinstance(_root(d), ast.Name) and _root(d).id == "compat"
               for d in getattr(node, "decorator_list", []))


def library_internal_uses(paths: list[Path]) -> list[str]:
    """Every use of another library's private name in `paths` (file:line: what):
    - importing a private module or name of another library;
    - `x._name` (or getattr(x, "_name")) where `x` is, or is reached from, a name bound by
      importing another library (`torch._foreach_norm`, `nn.modules.batchnorm._BatchNorm`,
      `atexit._clear`);
    - inside a class, defining or using through `self` a private name that one of the class's
      bases from another library has (`self._trainer` in a LightningModule, an override of
      `nn.Module._apply`), unless the override is declared through a compat.py decorator (which
      may then call the library's own through `super()`);
    - anywhere else, `x._name` where no class or module of fl_lightning defines `_name` (an object
      of another library reached any other way)."""
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in paths}
    inherited_by_node: dict[int, set[str]] = {}
    for path, tree in trees.items():
        for cls_node, inherited in _class_scopes(path, tree):
            for node in ast.walk(cls_node):
                inherited_by_node.setdefault(id(node), set()).update(inherited)
    own = _own_names(trees.values(), inherited_by_node)
    found = []
    for path, tree in trees.items():
        found += _private_imports_and_overrides(_shown(path), tree, inherited_by_node)
        found += _private_attributes(_shown(path), tree, inherited_by_node, own)
    return sorted(set(found))


def _own_names(trees, inherited_by_node: dict[int, set[str]]) -> set[str]:
    """What fl_lightning defines itself: functions, classes, assigned names and self attributes."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            inherited = inherited_by_node.get(id(node), set())
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name not in inherited:
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value)
                  and node.attr not in inherited):
                own.add(node.attr)
    return own


def _private_imports_and_overrides(where: str, tree, inherited_by_node: dict[int, set[str]]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and not _ours(node.module):
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                      if any(map(_private, a.name.split(".")))]
        elif (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
              and node.name in inherited_by_node.get(id(node), set()) and not _declared_by_compat(node)):
            found.append(f"{where}:{node.lineno}: def {node.name} (overrides a library's internal)")
    return found


def _private_attributes(where: str, tree, inherited_by_node: dict[int, set[str]], own: set[str]) -> list[str]:
    found = []
    library = _library_bindings(tree)
    declared = {id(call) for fn in ast.walk(tree) if _declared_by_compat(fn)  # the overridden method itself
                for call in ast.walk(fn) if isinstance(call, ast.Attribute) and call.attr == fn.name
                and _is_self(call.value) and isinstance(call.value, ast.Call)}
    for node, obj, name in _attribute_uses(tree):
        if not _private(name) or name in DOCUMENTED_UNDERSCORE_NAMES or id(node) in declared:
            continue
        root = _root(obj)
        if isinstance(root, ast.Name) and root.id in library:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif _is_self(obj) and name in inherited_by_node.get(id(node), set()):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (a library base's)")
        elif name not in own:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (defined nowhere in fl_lightning)")
    return found


PROBE = """
import atexit
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
import lightning as L
from fl_lightning import compat


class Declared(nn.Linear):
    @compat.overrides_module_internal
    def _apply(self, fn, recurse=True):
        return super()._apply(fn, recurse)


class Probe(L.LightningModule):
    def _apply(self, fn, recurse=True):
        return super()._apply(fn, recurse)

    def attached(self):
        return self._trainer

    def mine(self):
        self._mine = 1
        return self._mine


def f(x, m):
    atexit._clear()
    torch._foreach_norm([x])
    getattr(m, '_load_state_dict_pre_hooks')
    return nn.modules.batchnorm._BatchNorm, m._modules, x._mine
"""


def test_library_internal_uses_sees_each_kind_of_use(tmp_path):
    """The checker finds each kind of internal it names (so its empty answer below means something)."""
    source = tmp_path / "probe.py"
    source.write_text(PROBE)
    found = [line.split(": ", 1)[1] for line in library_internal_uses([source])]
    assert sorted(found) == sorted([
        "from torch.nn.modules.batchnorm import _NormBase", "def _apply (overrides a library's internal)",
        "super()._apply (a library base's)", "self._trainer (a library base's)", "atexit._clear",
        "torch._foreach_norm", "getattr(m, '_load_state_dict_pre_hooks') (defined nowhere in fl_lightning)",
        "nn.modules.batchnorm._BatchNorm", "m._modules (defined nowhere in fl_lightning)"])


def test_library_internals_appear_only_in_compat():
    """Every internal of Lightning, torch, W&B, jsonargparse or CPython fl_lightning relies on is
    behind one function of compat.py, whose test (tests/test_compat.py) fails when the library
    changes under it; nowhere else reaches into a library."""
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p != COMPAT)
    assert len(modules) > 80
    found = library_internal_uses(modules)
    assert found == []
