"""`fl-lightning sweep`: spec expansion, command construction, validation before anything starts,
and a real local sweep that is killed (SIGKILL of its process group) and started again."""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from fl_test_utils import reproducible_rows

from fl_lightning import sweep
from fl_lightning.checkpointing import completed_rounds
from fl_lightning.cli import main
from fl_lightning.errors import FLUserError
from fl_lightning.outcome import EXIT_STOPPED
from fl_lightning.results import read_metrics

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted([*(REPO / "configs" / "sweeps").glob("*.yaml"), *(REPO / "configs" / "tables").glob("*.yaml")])
TINY = ["--config", str(REPO / "configs/settings/mnist5k.yaml"), "--data.dataset=digits",
        "--model.init_args.model=mlp", "--data.num_clients=4", "--data.sample_ratio=0.5", "--data.local_epochs=1",
        "--data.batch_size=32", "--data.alpha=1.0", "--federation.eval_local_models=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def write_spec(path: Path, parameters: dict, method: str = "grid", command=None, **extra) -> Path:
    spec = {"name": path.stem, "method": method, "parameters": parameters,
            "command": command or ["${env}", "fl-lightning", "fit", *TINY, "${args}"], **extra}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(args)
    code = stop.value.code
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# Expansion and commands


def test_grid_expands_to_the_product_in_spec_order_with_wandb_formatting(tmp_path):
    path = write_spec(tmp_path / "g.yaml", {
        "config": {"values": ["configs/methods/fedsol/fedavg.yaml", "configs/methods/fedsol/fedsol.yaml"]},
        "data.alpha": {"values": [0.05, 0.5]},
        "model.init_args.lr_milestones": {"value": [160, 240]},
        "seed_everything": {"values": [0]},
    }, command=["${env}", "fl-lightning", "fit", "--config", "configs/settings/fedsol_cifar10.yaml", "${args}",
                      "--data.download=false"])
    spec = sweep.load_spec(path)
    runs = sweep.plan(spec, Path("runs"), validate=False)
    # named by what varies; the single-valued milestones and seed are in every command
    assert [r.name for r in runs] == ["config=fedavg,alpha=0.05", "config=fedavg,alpha=0.5", "config=fedsol,alpha=0.05",
                                      "config=fedsol,alpha=0.5"]
    assert runs[1].args == [
        "fit", "--config", "configs/settings/fedsol_cifar10.yaml", "--config=configs/methods/fedsol/fedavg.yaml",
        "--data.alpha=0.5", "--model.init_args.lr_milestones=[160, 240]",
        "--seed_everything=0", "--data.download=false", f"--trainer.default_root_dir=runs/g/{runs[1].name}",
    ]


def test_seeded_random_search_draws_the_same_commands_for_the_same_seed(tmp_path):
    path = write_spec(tmp_path / "r.yaml", {
        "model.init_args.rho": {"distribution": "log_uniform_values", "min": 0.1, "max": 4.0},
        "data.local_epochs": {"distribution": "int_uniform", "min": 1, "max": 3},
        "model.init_args.temperature": {"values": [1.0, 3.0]},
        "trainer.max_epochs": {"value": 2},
    }, method="random", run_cap=40)
    spec = sweep.load_spec(path)
    a, b, c = sweep.expand(spec, seed=0), sweep.expand(spec, seed=0), sweep.expand(spec, seed=1)
    assert a == b and a != c and len(a) == 40
    rho = np.array([p["model.init_args.rho"] for p in a])
    assert rho.min() >= 0.1 and rho.max() <= 4.0
    assert np.median(rho) < 1.0  # log-uniform on [0.1, 4]: median sqrt(0.4) = 0.63, uniform's would be 2.05
    assert {p["data.local_epochs"] for p in a} == {1, 2, 3}
    assert all(isinstance(p["data.local_epochs"], int) for p in a)
    assert {p["model.init_args.temperature"] for p in a} == {1.0, 3.0}
    assert {p["trainer.max_epochs"] for p in a} == {2}
    runs = sweep.plan(spec, Path("runs"), seed=0, count=3, validate=False)
    assert [r.name.split(",")[0] for r in runs] == ["r000", "r001", "r002"]
    assert runs[0].args[-5:-1] == [f"--model.init_args.rho={a[0]['model.init_args.rho']}",
                                   f"--data.local_epochs={a[0]['data.local_epochs']}",
                                   f"--model.init_args.temperature={a[0]['model.init_args.temperature']}",
                                   "--trainer.max_epochs=2"]


def test_run_names_tell_keys_with_the_same_last_part_apart():
    assert sweep.short_keys(["data.alpha", "model.init_args.alpha", "model.class_path", "seed_everything"]) == {
        "data.alpha": "data.alpha", "model.init_args.alpha": "init_args.alpha", "model.class_path": "model",
        "seed_everything": "seed"}


# ---------------------------------------------------------------------------------------------
# Every shipped sweep and table parses through the CLI


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_command_of_every_shipped_sweep_parses(path):
    spec = sweep.load_spec(path)
    if spec.config["method"] == "bayes":  # a draw of its space (the W&B server picks the points)
        spec = sweep.Spec(spec.name, {**spec.config, "method": "random", "run_cap": 3}, spec.path)
    every = sweep.plan(spec, Path("runs"), validate=False)
    assert every and len({r.name for r in every}) == len(every)
    # Every command up to its seed (seeds only change an int, and the suite runs on 2 shared cores).
    params = {k: ({"values": p["values"][:1]} if k in sweep.SEED_KEYS and "values" in p else p)
              for k, p in spec.config["parameters"].items()}
    one_seed = sweep.Spec(spec.name, {**spec.config, "parameters": params}, spec.path)
    runs = sweep.plan(one_seed, Path("runs"), validate=True)
    seeds = len(spec.config["parameters"].get("seed_everything", {}).get("values", [0]))
    assert len(runs) * (seeds if spec.config["method"] == "grid" else 1) == len(every)
    resolved = sweep.parse_with_cli(runs[-1].args)
    assert resolved["trainer"]["default_root_dir"] == f"runs/{spec.name}/{runs[-1].name}"
    for key, value in runs[-1].params.items():
        if key != "config":
            node = resolved
            for part in key.split("."):
                node = node[part]
            assert node == value or str(node).endswith(f".{value}") or str(node) == str(value), key


def test_table_files_name_their_paper_and_published_numbers():
    for path in (REPO / "configs" / "tables").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        assert doc["paper"] and doc["table"], path
        entries = doc["published"]["entries"]
        assert entries and all("match" in e and ("acc" in e) for e in entries), path


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before anything starts


@pytest.mark.parametrize(("parameters", "extra", "message"), [
    ({"model.init_args.no_such_option": {"values": [1]}}, {}, "no_such_option"),
    ({"no_such_group.x": {"values": [1]}}, {}, "no_such_group"),
    ({"data.alpha": {"values": []}}, {}, "empty grid"),
    ({}, {}, "empty grid"),
    ({"data.alpha": {"values": [0.1]}, "config": {"values": ["a.yaml"]}}, {}, "must be the first parameter"),
    ({"data.alpha": {"values": [0.1]}}, {"command": ["fl-lightning", "fit", "${args_no_hyphens}"]}, "args_no_hyphens"),
    ({"data.alpha": {"values": [0.1]}}, {"method": "bayes"}, "bayes needs the W&B sweep server"),
])
def test_bad_specs_are_one_line_and_exit_2_before_any_run(tmp_path, parameters, extra, message):
    spec = {"name": "bad", "method": "grid", "parameters": parameters,
            "command": ["${env}", "fl-lightning", "fit", *TINY, "${args}"], **extra}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    code, out, err = run_cli(["sweep", str(path), "--local", "--root", str(tmp_path / "runs")])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "runs").exists()  # nothing started
    # the warm worker starts importing while the commands are parsed; a refused spec ends it
    assert warm_worker_children() == []


def warm_worker_children() -> list[int]:
    """Live (not zombie) processes of this one's that are warm sweep workers."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            if int(fields["PPid"]) == os.getpid() and not fields["State"].startswith("Z"):
                if b"_warm_worker" in (status.parent / "cmdline").read_bytes():
                    found.append(int(status.parent.name))
    return found


def test_gpus_naming_an_absent_gpu_is_refused(tmp_path):
    path = write_spec(tmp_path / "g.yaml", {"data.alpha": {"values": [0.1]}})
    code, _, err = run_cli(["sweep", str(path), "--local", "--gpus", f"0,{torch.cuda.device_count()}",
                            "--root", str(tmp_path / "runs")])
    assert code == 2 and f"no GPU {torch.cuda.device_count()}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
    assert sweep.parse_gpus("0,2", 4) == ["0", "2"]
    with pytest.raises(FLUserError, match="no GPU 4"):
        sweep.parse_gpus("1,4", 4)
    with pytest.raises(FLUserError, match="indices"):
        sweep.parse_gpus("a", 4)


def test_workers_get_a_gpu_each_or_a_share_of_the_cores():
    assert sweep.worker_envs(3, ["0", "2"], cores=8) == [
        {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "0"}]
    cpu = sweep.worker_envs(2, None, cores=2)
    assert [e["OMP_NUM_THREADS"] for e in cpu] == ["1", "1"]
    assert sweep.worker_envs(3, None, cores=8)[0]["OMP_NUM_THREADS"] == "2"


def test_online_sweep_starts_one_agent_per_gpu_and_needs_a_login(tmp_path, monkeypatch):
    commands = sweep.agent_commands("me/fl-lightning/abc123", ["0", "1", "3"], workers=1, count=5)
    assert [env for env, _ in commands] == [{"CUDA_VISIBLE_DEVICES": g} for g in ("0", "1", "3")]
    for _, argv in commands:
        assert Path(argv[0]).name == "wandb" and argv[1:] == ["agent", "--count", "5", "me/fl-lightning/abc123"]
    assert len(sweep.agent_commands("x", None, workers=2, count=None)) == 2
    path = write_spec(tmp_path / "o.yaml", {"data.alpha": {"values": [0.1]}})
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, _, err = run_cli(["sweep", str(path)])
    assert code == 2 and "--local" in err
    # A run launched by an agent gets its own directory, named by the sweep and run ids.
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")
    monkeypatch.setenv("WANDB_RUN_ID", "r9")
    assert sweep.agent_run_dir_args(["fit", "--config", "x.yaml"])[-1] == "--trainer.default_root_dir=runs/abc123/r9"


def test_dry_run_prints_every_command_and_starts_nothing(tmp_path):
    path = write_spec(tmp_path / "d.yaml", {"seed_everything": {"values": [0, 1, 2]}})
    code, out, _ = run_cli(["sweep", str(path), "--local", "--dry-run", "--root", str(tmp_path / "runs")])
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("fl-lightning fit --config") for line in lines)
    assert [line.split("--seed_everything=")[1].split()[0] for line in lines] == ["0", "1", "2"]
    assert not (tmp_path / "runs" / "d").exists()


def test_restart_skips_finished_resumes_checkpointed_and_overwrites_the_rest(tmp_path, capsys):
    spec = sweep.load_spec(write_spec(tmp_path / "s.yaml", {"seed_everything": {"values": [0, 1, 2, 3, 4]}}))
    runs = sweep.plan(spec, tmp_path / "runs", validate=False)
    local = sweep.LocalSweep(spec, runs, tmp_path / "runs", workers=[])
    d = tmp_path / "runs" / "s"
    (d / "seed=0" / "checkpoints").mkdir(parents=True)
    (d / "seed=0" / "summary.json").write_text(json.dumps({"finished": True}))
    (d / "seed=1" / "checkpoints").mkdir(parents=True)
    (d / "seed=1" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (d / "seed=1" / "summary.json").write_text(json.dumps({"finished": False, "rounds_completed": 3}))
    (d / "seed=2").mkdir()
    (d / "seed=2" / "config.yaml").write_text("{}")  # killed before its first round: no checkpoint
    (d / ".sweep").mkdir()
    (d / ".sweep" / "seed=3.json").write_text(json.dumps({"exit_code": EXIT_STOPPED}))  # diverged: final
    (d / "seed=3").mkdir()
    (d / "seed=3" / "summary.json").write_text(json.dumps({"finished": False, "diverged": True}))
    states = [local.command(r)[1] for r in runs]
    assert states == ["finished", "resume", "restart", "diverged", "new"]
    assert local.command(runs[1])[0][-1] == "--ckpt_path=last"
    assert local.command(runs[2])[0][-1] == "--overwrite=true"
    assert local.command(runs[4])[0] == runs[4].args
    local.dry_run()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# finished: seed=0" and out[3] == "# diverged: seed=3"
    assert out[1].endswith("--ckpt_path=last") and out[4].startswith("fl-lightning fit ")


# ---------------------------------------------------------------------------------------------
# A real local sweep, killed and started again


def env(**extra) -> dict:
    e = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
             **extra)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), e.get("PYTHONPATH", "")])
    return e


def start_sweep(spec: Path, root: Path, workers: int = 2, **extra_env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fl_lightning.cli", "sweep", str(spec), "--local",
                             "--workers", str(workers), "--root", str(root)], cwd=REPO, env=env(**extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def summary(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def test_killed_sweep_restarts_skipping_finished_runs_and_resuming_the_others(tmp_path):
    # One worker runs the grid in order: the two 1-round runs, then the first 8-round run, in which
    # the kill switch (armed only in this first start) SIGKILLs the whole sweep, every process of
    # its session, right after that run's round-3 client trained: an exact point, whatever the
    # machine's load. The second 8-round run has not started.
    kill = {"class_path": "killswitch.KillSwitch",
            "init_args": {"round": 3, "where": "train", "group": True, "armed_by": "FL_TEST_KILL_SWEEP"}}
    command = ["${env}", "fl-lightning", "fit", *TINY, f"--trainer.callbacks+={json.dumps(kill)}", "${args}"]
    spec = write_spec(tmp_path / "tiny.yaml", {"trainer.max_epochs": {"values": [1, 8]},
                                               "seed_everything": {"values": [0, 1]}}, command=command)
    root = tmp_path / "runs"
    sweep_dir = root / "tiny"
    names = ["max_epochs=1,seed=0", "max_epochs=1,seed=1", "max_epochs=8,seed=0", "max_epochs=8,seed=1"]
    shorts, long_, untouched = [sweep_dir / n for n in names[:2]], sweep_dir / names[2], sweep_dir / names[3]
    proc = start_sweep(spec, root, workers=1, FL_TEST_KILL_SWEEP="1")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == -signal.SIGKILL, out
    assert all(summary(run).get("finished") for run in shorts)
    assert completed_rounds(torch.load(long_ / "checkpoints" / "last.ckpt", weights_only=True)) == 2
    assert not summary(long_).get("finished") and not untouched.exists()
    first_summaries = {run: (run / "summary.json").stat().st_mtime_ns for run in shorts}

    again = start_sweep(spec, root, workers=1)
    out, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out
    assert "4 runs (2 already done)" in out
    for name in names:
        assert summary(sweep_dir / name)["finished"], name
    # The finished runs were not run again; the interrupted one resumed from its checkpoint.
    for run, mtime in first_summaries.items():
        assert (run / "summary.json").stat().st_mtime_ns == mtime
        assert f"start {run.name}" not in out
    assert f"resume {long_.name}" in out and f"start {untouched.name}" in out
    record = json.loads((sweep_dir / ".sweep" / f"{long_.name}.json").read_text())
    assert record["attempts"] == 2 and "--ckpt_path=last" in record["command"]

    # The resumed run, forked by a warm worker, equals an uninterrupted run of the same command
    # started on its own, in the same environment (the worker's thread count: a different one may
    # sum in another order).
    straight = tmp_path / "straight"
    command = [a for a in record["command"][1:] if not a.startswith(("--ckpt_path", "--trainer.default_root_dir"))]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    done = subprocess.run([sys.executable, "-m", "fl_lightning.cli", *command,
                           f"--trainer.default_root_dir={straight}"], cwd=REPO,
                          env={**env(), **sweep.worker_envs(1, None, cores)[0]}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    a = torch.load(long_ / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    b = torch.load(straight / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_resumed, rows_straight = read_metrics(long_ / "metrics.csv"), read_metrics(straight / "metrics.csv")
    assert [r["round"] for r in rows_resumed] == list(range(1, 9))
    assert reproducible_rows(rows_resumed) == reproducible_rows(rows_straight)
    # The four runs share their partition: its picture was drawn once for the sweep, and each run
    # has it byte for byte as the run started on its own (no shared folder) drew it.
    assert len(list((sweep_dir / ".sweep" / "pictures").glob("*.png"))) == 1
    drawn = (straight / "analysis" / "partition.png").read_bytes()
    assert all((sweep_dir / name / "analysis" / "partition.png").read_bytes() == drawn for name in names)

    # The report over the sweep: two rows (1 and 8 rounds), two seeds each.
    code, table, _ = run_cli(["report", str(sweep_dir)])
    assert code == 0
    body = [line for line in table.splitlines() if line.startswith(("| FedAvg | 1 ", "| FedAvg | 8 "))]
    assert len(body) == 2 and all(line.rstrip(" |").endswith("| 2") for line in body), table


def test_a_failing_run_is_recorded_and_the_others_finish(tmp_path):
    # 5,000 clients cannot share 1,797 digits: that run stops at start-up with its one-line error.
    spec = write_spec(tmp_path / "f.yaml", {"data.num_clients": {"values": [5000, 4]},
                                            "trainer.max_epochs": {"value": 1}})
    proc = start_sweep(spec, tmp_path / "runs")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    sweep_dir = tmp_path / "runs" / "f"
    assert summary(sweep_dir / "num_clients=4")["finished"]
    record = json.loads((sweep_dir / ".sweep" / "num_clients=5000.json").read_text())
    assert record["status"] == "crashed" and record["exit_code"] == 2
    assert record["error"].startswith("error: ") and "5000" in record["error"]
    assert "FAILED num_clients=5000 (exit 2): error: " in out
    code, table, _ = run_cli(["report", str(sweep_dir)])
    assert code == 0 and f"num_clients=5000: crashed: {record['error']}" in table


@pytest.mark.parametrize("parameter,extra,message", [
    ({"values": [1, 2]}, {"run_cap": "many"}, r"run_cap must be a whole number of runs >= 1, got 'many'"),
    ({"values": [1, 2], "probabilities": [0.5, 0.6]}, {}, r"`probabilities` must sum to 1, they sum to 1.1"),
    ({"values": [1, 2], "probabilities": [1.0]}, {}, r"`probabilities` must be 2 numbers >= 0, one per value"),
    ({"distribution": "log_uniform_values", "min": -1.0, "max": 1.0}, {},
     r"log_uniform_values draws the logarithm of its values: min must be > 0, got -1.0"),
    ({"distribution": "int_uniform", "min": 5, "max": 2}, {}, r"min \(5\) is greater than max \(2\)"),
    ({"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0}, {}, r"q must be a number > 0"),
    ({"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": -0.5}, {}, r"q must be a number > 0"),
    ({"distribution": "uniform", "min": "a", "max": 1.0}, {}, r"uniform needs numbers min and max"),
    ({"distribution": "int_uniform", "min": 0.5, "max": 3}, {}, r"int_uniform needs integers min and max"),
    ({"distribution": "normal", "mu": 0.0, "sigma": -1.0}, {}, r"normal needs a number mu and a number sigma > 0"),
    ({"distribution": "beta"}, {}, r"distribution 'beta' is not supported by --local"),
])
def test_a_malformed_random_spec_is_one_line(tmp_path, parameter, extra, message):
    path = write_spec(tmp_path / "r.yaml", {"model.init_args.lr": parameter}, method="random",
                      **({"run_cap": 3} | extra))
    code, _, err = run_cli(["sweep", str(path), "--local", "--dry-run", "--root", str(tmp_path / "runs")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"error: .*{message}", err), err


@pytest.mark.parametrize("count", ["-1", "0"])
def test_a_count_below_one_is_refused_not_a_shorter_grid(tmp_path, count):
    path = write_spec(tmp_path / "g.yaml", {"seed_everything": {"values": [0, 1, 2]}})
    code, _, err = run_cli(["sweep", str(path), "--local", "--dry-run", "--count", count,
                            "--root", str(tmp_path / "runs")])
    assert code == 2 and err.strip() == f"error: --count {count}: the number of runs must be at least 1", err


def test_a_damaged_record_is_read_as_absent_fields_and_the_sweep_rewrites_it(tmp_path):
    """A record with fields of the wrong type once killed the worker thread (`attempts: "two"` + 1),
    and the sweep exited 0 with that run never started."""
    spec = sweep.load_spec(write_spec(tmp_path / "s.yaml", {"seed_everything": {"values": [0]}}))
    runs = sweep.plan(spec, tmp_path / "runs", validate=False)
    local = sweep.LocalSweep(spec, runs, tmp_path / "runs", workers=[])
    path = local.record_path(runs[0])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"attempts": "two", "index": "first", "status": 3, "exit_code": True, "note": "x"}))
    assert sweep.read_record(path) == {"note": "x"}
    record = local.write_record(runs[0], attempts=(sweep.read_record(path) or {}).get("attempts", 0) + 1)
    assert record["attempts"] == 1 and record["index"] == 0
    path.write_text("{truncated")
    assert sweep.read_record(path) is None


def test_a_parser_built_before_the_run_serves_one_run_and_parses_as_one_built_for_it(tmp_path, monkeypatch):
    # A warm worker builds fit's parser once, before it forks its runs (lightning_cli.prebuild_parser).
    from fl_lightning import lightning_cli

    monkeypatch.setattr(lightning_cli.FLCLI, "prebuilt", {})
    built = []
    init_parser = lightning_cli.FLCLI.init_parser
    monkeypatch.setattr(lightning_cli.FLCLI, "init_parser", lambda self, **k: built.append(1) or init_parser(self, **k))
    lightning_cli.prebuild_parser()
    built.clear()
    fit = ["fit", *TINY, "--trainer.max_epochs=1"]

    def run_in_process(args):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                main(args)
            except SystemExit as stop:
                return stop.code, err.getvalue()
        return 0, err.getvalue()

    assert run_in_process([*fit, f"--trainer.default_root_dir={tmp_path / 'prebuilt'}"])[0] == 0
    assert built == []  # parsed with the parser built before
    assert run_in_process([*fit, f"--trainer.default_root_dir={tmp_path / 'own'}"])[0] == 0
    assert built  # the next run of the process builds its own
    prebuilt, own = ((tmp_path / d / "config.yaml").read_text().replace(str(tmp_path / d), "<run>")
                     for d in ("prebuilt", "own"))
    assert prebuilt == own
    # a mistake in the command is the same one line either way
    lightning_cli.prebuild_parser()
    typo = [*fit, "--data.num_clientz=3", f"--trainer.default_root_dir={tmp_path / 'typo'}"]
    code, err_prebuilt = run_in_process(typo)
    assert code == 2 and "num_clientz" in err_prebuilt and not lightning_cli.FLCLI.prebuilt
    assert run_in_process(typo) == (2, err_prebuilt)


def test_the_rho_sweep_logs_figure_3s_whole_model_cosine_and_a_plain_fedsol_run_does_not():
    """FedSOL's default logs its cosine over the perturbed tensors only (a step costs the paper's
    two backward passes); the rho sweep, run in Fig. 3's setting, asks for the whole-model one."""
    spec = sweep.load_spec(Path("configs/sweeps/fedsol_rho.yaml"))
    swept = sweep.parse_with_cli(sweep.plan(spec, Path("runs"), validate=False)[0].args)
    assert swept["model"]["init_args"]["cosine_scope"] == "all"
    plain = sweep.parse_with_cli(["fit", "--config", "configs/settings/fedsol_cifar10.yaml",
                                  "--config", "configs/methods/fedsol/fedsol.yaml"])
    assert plain["model"]["init_args"]["cosine_scope"] == "perturbed"
