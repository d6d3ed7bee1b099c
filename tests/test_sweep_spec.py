"""`fl-lightning sweep`: every way a spec file is refused by load_spec (fl_lightning/sweep/spec.py) is
one exact `error:` line and exit 2, before anything is parsed, started or written."""

import contextlib
import io

import pytest
import yaml

from fl_lightning.cli import main

COMMAND = ["${env}", "fl-lightning", "fit", "--config", "configs/settings/mnist5k.yaml", "${args}"]
GOOD = {"method": "grid", "parameters": {"seed_everything": {"values": [0, 1]}}, "command": COMMAND}
MAPPING = "must be a mapping such as {values: [...]}"
RUNS_FL = "`command` must run fl-lightning, e.g. [${env}, fl-lightning, fit, --config, configs/x.yaml, ${args}]"
METHOD = "method must be one of grid, random, bayes, got"


def without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


@pytest.mark.parametrize(("doc", "message"), [
    (None, "no such file"),
    ("a: [1\n", "not valid YAML (while parsing a flow sequence)"),
    ("- 1\n- 2\n", "expected a W&B sweep config (method, parameters, command)"),
    ({"paper": "x", "sweep": [1]}, "expected a W&B sweep config (method, parameters, command)"),
    ({**GOOD, "method": "hyperband"}, f"{METHOD} 'hyperband'"),
    (without("method"), f"{METHOD} None"),
    ({"paper": "x", "sweep": {**GOOD, "method": "hyperband"}}, f"{METHOD} 'hyperband'"),  # a table's `sweep:`
    (without("parameters"), "empty grid: `parameters` must name at least one CLI option"),
    ({**GOOD, "parameters": ["data.alpha"]}, "empty grid: `parameters` must name at least one CLI option"),
    ({**GOOD, "parameters": {"data.alpha": 0.1}}, f"parameter data.alpha {MAPPING}"),
    ({**GOOD, "parameters": {"data.alpha": {"values": 0.1}}}, "empty grid: parameter data.alpha has no values"),
    ({**GOOD, "parameters": {"model": {"parameters": {"rho": {"values": [1]}}}}},
     "nested parameter model: name options by their dotted CLI key instead (e.g. model.init_args.rho)"),
    ({**GOOD, "parameters": {"data.alpha": {"values": [0.1]}, "config": {"values": ["a.yaml"]}}},
     "a swept `config` must be the first parameter, so that the options after it override the file and not "
     "the other way round"),
    (without("command"), RUNS_FL),
    ({**GOOD, "command": ["python", "train.py", "${args}"]}, RUNS_FL),
    ({**GOOD, "command": ["fl-lightning", "fit", "${args_no_hyphens}"]},
     "use ${args} (--key=value) in `command`: jsonargparse does not read ${args_no_hyphens} (key=value) and "
     "would ignore the swept values"),
    ({**GOOD, "name": "a/b"}, "name 'a/b' must be a plain directory name"),
    ({**GOOD, "name": ".hidden"}, "name '.hidden' must be a plain directory name"),
], ids=["missing", "yaml", "list", "table-list", "method", "no-method", "table-method", "no-parameters",
        "parameters-list", "not-mapping", "values-not-list", "nested", "config-not-first", "no-command",
        "command-not-fl", "args-no-hyphens", "name-slash", "name-dot"])
def test_a_bad_spec_file_is_one_exact_line_and_exit_2(tmp_path, doc, message):
    path = tmp_path / "bad.yaml"
    if doc is not None:
        path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(["sweep", str(path), "--local", "--dry-run", "--root", str(tmp_path / "runs")])
    assert stop.value.code == 2
    assert err.getvalue() == f"error: sweep spec {path}: {message}\n"
    assert out.getvalue() == "" and not (tmp_path / "runs").exists()
