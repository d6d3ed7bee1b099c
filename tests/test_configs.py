"""Every shipped config parses with the CLI and names a method, a model and a dataset that exist.
(Most configs need real datasets, so they are parsed, not trained, here.)"""

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from fl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1] / "configs"
# demo_* files are overlays added to a full config; methods/ holds method overlays (tested below);
# sweeps/ and tables/ are W&B sweep specs (tests/test_sweep.py parses every command they run).
CONFIGS = sorted(p for p in ROOT.rglob("*.yaml")
                 if "demo_" not in p.name and p.relative_to(ROOT).parts[0] not in ("methods", "sweeps", "tables"))
METHOD_OVERLAYS = sorted((ROOT / "methods").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_config_parses(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(path), "--print_config"])
    assert stop.value.code in (0, None)
    resolved = yaml.safe_load(out.getvalue())
    assert resolved["model"]["class_path"].startswith("fl_lightning.methods.")
    assert resolved["trainer"]["max_epochs"] >= 1
    assert resolved["data"]["dataset"]


def test_demo_overlay_parses():
    base = Path(__file__).resolve().parents[1] / "configs" / "fedorgp"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--config", str(base / "fedorgp_cifar10_pathological.yaml"),
              "--config", str(base / "demo_mnist5k_hmg3.yaml"), "--print_config"])
    assert yaml.safe_load(out.getvalue())["data"]["dataset"] == "mnist5k"


@pytest.mark.parametrize("path", METHOD_OVERLAYS, ids=lambda p: str(p.relative_to(ROOT)))
def test_method_overlay_sets_its_method_over_the_setting(path):
    """configs/methods/<paper>/<method>.yaml layered over that paper's setting (the command in its header)."""
    setting = ROOT.parent / path.read_text().split("--config ")[1].split()[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--config", str(setting), "--config", str(path), "--print_config"])
    resolved = yaml.safe_load(out.getvalue())
    overlay = yaml.safe_load(path.read_text())["model"]
    assert resolved["model"]["class_path"] == overlay["class_path"]
    for key, value in (overlay.get("init_args") or {}).items():
        assert resolved["model"]["init_args"][key] == value, key
    for key, value in yaml.safe_load(setting.read_text())["data"].items():
        assert resolved["data"][key] == value, key  # the setting is untouched
