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
