"""scripts/gpu_check.sh's CPU part, as a user without a GPU meets it: every row passes, the script
says it ran the CPU part only and exits 0; a family whose run fails is a FAIL row and exit 1."""

import subprocess
import sys

from test_cli import REPO
from test_outcomes import env


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    # the interpreter running the tests (a checkout without its own .venv would fall back to python3)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=REPO,
                          env={**env(), "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)


def test_the_cpu_part_passes_and_says_there_is_no_gpu(tmp_path):
    done = gpu_check("--families", "FedAvg", "FedORGP", "--root", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("FedAvg ", "FedORGP "))]
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [("FedAvg", "cpu", "32-true", "pass"),
                                                        ("FedORGP", "cpu", "32-true", "pass")]
    assert all(0.0 <= float(r[5]) <= 1.0 and 0.0 < float(r[6]) < 1000.0 for r in rows)  # accuracy, ms per step
    assert "no GPU on this machine" in done.stdout and done.stdout.strip().endswith("all passed")


def test_a_failing_run_is_a_fail_row_and_exit_1(tmp_path):
    (tmp_path / "FedAvg" / "cpu_32-true_1").mkdir(parents=True)
    (tmp_path / "FedAvg" / "cpu_32-true_1" / "summary.json").write_text("{}")  # a run already there: refused
    done = gpu_check("--families", "FedAvg", "--root", str(tmp_path))
    assert done.returncode == 1
    assert "FAIL: exit 2: error: " in done.stdout and done.stdout.strip().endswith("1 failed")
