"""How `--config` files compose into a run, and what the run is called.

A run is layered from files, left to right (a later file overrides an earlier one): a *setting*
(it has `data:`, the paper's setting), then one *method* file (it sets `model.class_path`), then
option overlays (e.g. `configs/methods/fedconst/const.yaml`, "+ CONST"). A file may also be a
list of such files (`layer: [setting.yaml, method.yaml]`, relative to itself): the one-file entry
to a paper's experiment, e.g. `configs/fedsol_cifar10.yaml`. The run is named after its files,
`<setting>/<method>[+<overlay>...]`; a setting alone runs its baseline method and is named
`<setting>/<baseline>` (so it never nests around the runs of its methods).

Mistakes in the layering are refused in one line before anything runs: a method file before the
setting (the setting would override the method's options), two method files (only the last would
run, under both names), a file that does not exist (naming a file of that name elsewhere under
configs/ when there is one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fl_lightning.errors import FLUserError

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _read(path: Path):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # jsonargparse reports an unreadable file in its own words


def _missing(path: str) -> FLUserError:
    """One line for a --config file that does not exist, naming the file of that name under
    configs/ (the working directory's, else the package's) or, for a name of the former
    one-file-per-experiment configs, the command that runs that experiment now."""
    name = Path(path).name
    roots = [Path("configs"), Path(__file__).resolve().parents[1] / "configs"]
    found: dict[Path, str] = {}  # the same file seen through both roots (or a symlink) once
    for root in roots:
        for p in sorted(root.rglob(name)) if root.is_dir() else ():
            found.setdefault(p.resolve(), os.path.relpath(p))
    if found:
        return FLUserError(f"--config {path}: no such file; did you mean {' or '.join(list(found.values())[:3])}?")
    command = _former_experiment(Path(name).stem, roots)
    if command:
        return FLUserError(f"--config {path}: no such file; that experiment is now {command} (configs/README.md)")
    return FLUserError(f"--config {path}: no such file")


def _former_experiment(stem: str, roots: list[Path]) -> str | None:
    """The command configs/README.md gives for a former one-file config (`| `fedsol_l2_cifar10` |
    `fl-lightning fit --config ...` | ...`), or None."""
    for root in roots:
        try:
            text = (root / "README.md").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            if len(cells) >= 2 and cells[0] == stem and cells[1].startswith("fl-lightning "):
                return f"`{cells[1]}`"
    return None


def expand_layers(path: str, depth: int = 0) -> list[str]:
    """The files a `--config` file stands for: itself, or the files its `layer:` list names."""
    file = Path(path)
    if not file.is_file():
        raise _missing(path)
    doc = _read(file)
    if not (isinstance(doc, dict) and set(doc) == {"layer"}):
        return [path]
    layers = doc["layer"]
    if depth > 8 or not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise FLUserError(f"--config {path}: `layer:` must be a list of config files (relative to {file.parent})")
    return [p for layer in layers for p in expand_layers(os.path.relpath(file.parent / layer), depth + 1)]


def layered_config_args(argv: list[str]) -> list[str]:
    """`argv` with every `--config X` replaced by the files X stands for, checked for layering."""
    out, files, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif arg.startswith("--config="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        expanded = expand_layers(value)
        files += expanded
        out += [a for f in expanded for a in ("--config", f)]
    check_layering(files)
    return out


def _role(path: str) -> tuple[str, str | None]:
    """("setting" | "method" | "overlay", the method class it sets or None)."""
    doc = _read(Path(path))
    if not isinstance(doc, dict):
        return "overlay", None
    model = doc.get("model")
    method = model.get("class_path") if isinstance(model, dict) else model if isinstance(model, str) else None
    method = str(method).rpartition(".")[2] if method else None
    if "data" in doc or "trainer" in doc:
        return "setting", method
    return ("method" if method else "overlay"), method


def check_layering(files: list[str]) -> None:
    """A setting first, then at most one method file (see the module docstring)."""
    roles = [(f, *_role(f)) for f in files]
    settings = [i for i, (_, role, _) in enumerate(roles) if role == "setting"]
    methods = [(f, m) for f, role, m in roles if role == "method"]
    first_method = next((i for i, (_, role, _) in enumerate(roles) if role == "method"), None)
    if settings and first_method is not None and first_method < settings[0]:
        raise FLUserError(f"--config {roles[first_method][0]} (a method file) comes before the setting "
                          f"{roles[settings[0]][0]}, which would override it: give the setting first "
                          f"(--config <setting> --config <method>)")
    if len(methods) > 1:
        chosen = ", ".join(f"{f} ({m})" for f, m in methods)
        raise FLUserError(f"two method files choose the method: {chosen}; a run has one method: layer one method "
                          f"file over the setting, and option overlays (files without model.class_path, such as "
                          f"configs/methods/fedconst/const.yaml) after it")


def run_name_from_configs(config_files: list, method: str | None = None) -> str | None:
    """`<setting>/<method>` from `--config <setting> --config <method> [...]`: the first file's stem,
    then the others' joined by `+` (`fedconst_crossdevice_cifar10/fedavg+const`); a setting alone
    is `<setting>/<its method, lower case>` when `method` (the run's method class) is given.
    None without a config file."""
    stems = [Path(str(f)).stem for f in config_files or [] if Path(str(f)).suffix in CONFIG_SUFFIXES]
    if not stems:
        return None
    if len(stems) == 1:
        return f"{stems[0]}/{method.lower()}" if method else stems[0]
    return f"{stems[0]}/{'+'.join(stems[1:])}"


def flatten_options(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config's nested sections as dotted options (`{"trainer": {"max_epochs": 3}}` ->
    `{"trainer.max_epochs": 3}`), the form in which a run's options are compared."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten_options(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}
