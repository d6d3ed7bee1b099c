"""The sweep spec: a W&B sweep configuration read from YAML, checked, and expanded into parameter sets.

A spec is the file a researcher writes (configs/sweeps/*.yaml, or the `sweep:` key of a paper
table in configs/tables/). It is checked here, before any run starts, for the mistakes that would
otherwise surface as a failed or silently wrong run much later (an empty grid, a nested parameter,
a `command` that does not reach fl-lightning, a distribution W&B would refuse); each is one line
naming the file and what would be right.

Expansion (`expand`) is what `--local` runs without W&B's sweep server: the product of a grid, in
spec order as W&B's grid search, or seeded draws of a random search from the distributions W&B's
random search supports. Bayes search needs the server and is not expanded here.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fl_lightning.errors import FLUserError

SEARCH_METHODS = ("grid", "random", "bayes")
# Option keys that make runs of one experiment differ only by their seed (`report` groups over them).
SEED_KEYS = ("seed_everything", "data.seed", "data.partition_seed")

NUMERIC_DISTRIBUTIONS = ("int_uniform", "uniform", "log_uniform_values", "q_uniform", "q_log_uniform_values")
DISTRIBUTIONS = ("categorical", "constant", *NUMERIC_DISTRIBUTIONS, "normal")


@dataclass
class Spec:
    """A W&B sweep configuration and the name its runs are grouped under."""

    name: str
    config: dict
    path: Path


# ---------------------------------------------------------------------------------------------
# Loading and checking


def load_spec(path: str | Path) -> Spec:
    """A W&B sweep config from a YAML file; a paper table (configs/tables/) holds it under `sweep:`."""
    path = Path(path)
    where = f"sweep spec {path}"
    doc = _read_config(path, where)
    method = doc.get("method")
    if method not in SEARCH_METHODS:
        raise FLUserError(f"{where}: method must be one of {', '.join(SEARCH_METHODS)}, got {method!r}")
    _check_parameters(where, doc.get("parameters"))
    _check_command(where, doc.get("command"))
    name = str(doc.get("name") or path.stem)
    if "/" in name or name.startswith("."):  # it names the sweep's directory below --root
        raise FLUserError(f"{where}: name {name!r} must be a plain directory name")
    return Spec(name=name, config=doc, path=path)


def _read_config(path: Path, where: str) -> dict:
    """The sweep config of a YAML file: the whole document, or its `sweep:` key (a paper table)."""
    if not path.is_file():
        raise FLUserError(f"{where}: no such file")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise FLUserError(f"{where}: not valid YAML ({str(err).splitlines()[0]})") from None
    if isinstance(doc, dict) and "sweep" in doc:
        doc = doc["sweep"]
    if not isinstance(doc, dict):
        raise FLUserError(f"{where}: expected a W&B sweep config (method, parameters, command)")
    return doc


def _check_parameters(where: str, params: Any) -> None:
    """`parameters`: at least one, each a flat definition named by its dotted CLI key, `config` first."""
    if not isinstance(params, dict) or not params:
        raise FLUserError(f"{where}: empty grid: `parameters` must name at least one CLI option")
    for key, p in params.items():
        if not isinstance(p, dict):
            raise FLUserError(f"{where}: parameter {key} must be a mapping such as {{values: [...]}}")
        if "values" in p and (not isinstance(p["values"], list) or not p["values"]):
            raise FLUserError(f"{where}: empty grid: parameter {key} has no values")
        if "parameters" in p:
            raise FLUserError(f"{where}: nested parameter {key}: name options by their dotted CLI key "
                              f"instead (e.g. model.init_args.rho)")
    if "config" in params and next(iter(params)) != "config":
        # ${args} follows the order of `parameters`; a --config after --data.alpha=... would undo it.
        raise FLUserError(f"{where}: a swept `config` must be the first parameter, so that the "
                          f"options after it override the file and not the other way round")


def _check_command(where: str, command: Any) -> None:
    """`command` runs fl-lightning with the swept values as `--key=value` (`${args}`)."""
    if not isinstance(command, list) or "fl-lightning" not in [str(c) for c in command]:
        raise FLUserError(f"{where}: `command` must run fl-lightning, e.g. "
                          f"[${{env}}, fl-lightning, fit, --config, configs/x.yaml, ${{args}}]")
    if "${args_no_hyphens}" in command:
        raise FLUserError(f"{where}: use ${{args}} (--key=value) in `command`: jsonargparse does not read "
                          f"${{args_no_hyphens}} (key=value) and would ignore the swept values")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def distribution_of(spec: Spec, key: str, p: dict) -> str:
    """The distribution a W&B parameter definition draws from, after checking the definition makes
    sense (the same classes of mistakes W&B's own sweep server refuses): one line naming the
    parameter and what is wrong otherwise."""
    where = f"sweep spec {spec.path}: parameter {key}"
    if "value" in p:
        return "constant"
    dist = p.get("distribution", "categorical" if "values" in p else None)
    lo, hi = p.get("min"), p.get("max")
    if dist is None and lo is not None and hi is not None:
        dist = "int_uniform" if isinstance(lo, int) and isinstance(hi, int) else "uniform"
    if dist not in DISTRIBUTIONS:
        raise FLUserError(f"{where}: distribution {dist!r} is not supported by --local (use values, value, "
                          f"{', '.join(NUMERIC_DISTRIBUTIONS)} or normal)")
    if dist == "categorical":
        _check_categorical(where, p)
    elif dist in NUMERIC_DISTRIBUTIONS:
        _check_range(where, dist, p)
    elif dist == "normal" and not (_number(p.get("mu", 0.0)) and _number(p.get("sigma", 1.0))
                                   and p.get("sigma", 1.0) > 0):
        raise FLUserError(f"{where}: normal needs a number mu and a number sigma > 0, got mu={p.get('mu')!r}, "
                          f"sigma={p.get('sigma')!r}")
    return dist


def _check_categorical(where: str, p: dict) -> None:
    values, probs = p.get("values"), p.get("probabilities")
    if not isinstance(values, list) or not values:
        raise FLUserError(f"{where}: `values` must be a non-empty list")
    if probs is None:
        return
    if not isinstance(probs, list) or len(probs) != len(values) or not all(_number(q) and q >= 0 for q in probs):
        raise FLUserError(f"{where}: `probabilities` must be {len(values)} numbers >= 0, one per value, got {probs!r}")
    if abs(sum(probs) - 1.0) > 1e-6:
        raise FLUserError(f"{where}: `probabilities` must sum to 1, they sum to {sum(probs):g}")


def _check_range(where: str, dist: str, p: dict) -> None:
    lo, hi = p.get("min"), p.get("max")
    if not (_number(lo) and _number(hi)):
        raise FLUserError(f"{where}: {dist} needs numbers min and max, got min={lo!r}, max={hi!r}")
    if dist == "int_uniform" and not (isinstance(lo, int) and isinstance(hi, int)):
        raise FLUserError(f"{where}: int_uniform needs integers min and max, got min={lo!r}, max={hi!r}")
    if lo > hi:
        raise FLUserError(f"{where}: min ({lo}) is greater than max ({hi})")
    if "log" in dist and lo <= 0:
        raise FLUserError(f"{where}: {dist} draws the logarithm of its values: min must be > 0, got {lo}")
    if dist.startswith("q_") and not (_number(p.get("q", 1.0)) and p.get("q", 1.0) > 0):
        raise FLUserError(f"{where}: q must be a number > 0 (values are rounded to multiples of q), "
                          f"got {p.get('q')!r}")


# ---------------------------------------------------------------------------------------------
# Expansion (--local)


def expand(spec: Spec, seed: int = 0, count: int | None = None) -> list[dict[str, Any]]:
    """The parameter sets of a grid (the product, in spec order, as W&B's grid search) or of a random
    search (`count` or the spec's `run_cap` draws from a generator seeded with `seed`)."""
    params = spec.config["parameters"]
    method = spec.config["method"]
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise FLUserError(f"--count {count}: the number of runs must be at least 1")
    if method == "grid":
        keys = list(params)
        grid = [dict(zip(keys, combo, strict=True))
                for combo in itertools.product(*(_grid_values(spec, k, params[k]) for k in keys))]
        return grid[:count] if count else grid
    if method == "random":
        cap = spec.config.get("run_cap")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise FLUserError(f"sweep spec {spec.path}: run_cap must be a whole number of runs >= 1, got {cap!r}")
        count = count or cap
        if not count:
            raise FLUserError(f"sweep spec {spec.path}: random search needs a number of runs: `run_cap` in the "
                              f"spec or --count N")
        for key, p in params.items():  # every definition checked before the first draw
            distribution_of(spec, key, p)
        rng = np.random.default_rng(seed)
        return [{k: _sample(spec, k, p, rng) for k, p in params.items()} for _ in range(int(count))]
    raise FLUserError(f"sweep spec {spec.path}: --local runs grid and random searches; bayes needs the W&B "
                      f"sweep server (run without --local)")


def _grid_values(spec: Spec, key: str, p: dict) -> list:
    if "values" in p:
        return list(p["values"])
    if "value" in p:
        return [p["value"]]
    raise FLUserError(f"sweep spec {spec.path}: grid parameter {key} needs `values` (or `value`), "
                      f"not a distribution")


def _sample(spec: Spec, key: str, p: dict, rng: np.random.Generator):
    """One draw from a W&B parameter definition (the distributions W&B's random search supports)."""
    dist = distribution_of(spec, key, p)
    lo, hi = p.get("min"), p.get("max")
    if dist == "constant":
        return p["value"]
    if dist == "categorical":
        return p["values"][int(rng.choice(len(p["values"]), p=p.get("probabilities")))]
    if dist == "int_uniform":
        return int(rng.integers(int(lo), int(hi) + 1))
    if dist == "uniform":
        return float(rng.uniform(lo, hi))
    if dist == "log_uniform_values":
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if dist in ("q_uniform", "q_log_uniform_values"):
        q = p.get("q", 1.0)
        x = rng.uniform(lo, hi) if dist == "q_uniform" else math.exp(rng.uniform(math.log(lo), math.log(hi)))
        return float(round(x / q) * q)
    return float(rng.normal(p.get("mu", 0.0), p.get("sigma", 1.0)))


def canonical(value: Any) -> str:
    """A value as the sweep's records store it (JSON), to compare a planned value with a recorded one."""
    return json.dumps(value, sort_keys=True, default=str)
