"""The package's layering: a method states its hooks and never reaches into the round driver that
calls them. Read from the source (the imports as written), so no import order can hide a breach."""

import ast
from pathlib import Path

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
