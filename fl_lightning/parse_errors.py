"""One line for every way a command line or config can be malformed.

jsonargparse reports a bad value over a dozen indented lines (a Union's subtypes, each subtype's
error, the value's Python type), and reports nested class arguments (`model.init_args.*`) inside
its `model` key's report. `summarise` reads that report and says in one line what is wrong and
what would be right: the option as the user types it (`--data.num_clients`), the value given, and
the values or type it accepts (a did-you-mean for a misspelt option or method). The CLI's one-line
error (`run_lifecycle.one_line_error`) calls it; anything it does not recognise still comes out as
one line, the report's first two.
"""

from __future__ import annotations

import difflib
import re
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

# jsonargparse's names of types -> what a user types
TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "NoneType": "null",
    "list": "a list, e.g. [1, 5]",
    "dict": "a mapping",
    "list[int]": "a list of integers, e.g. [1, 5]",
    "list[float]": "a list of numbers, e.g. [0.1, 0.5]",
    "list[str]": "a list of strings",
    "pathlib.Path": "a path",
    "fl_lightning.methods.base.FederatedMethod": "a method class",
}

CONFIG_SECTIONS = "seed_everything, trainer, model, data, federation, personalization"


def split_top_level(text: str) -> list[str]:
    """Splits 'a, b[c, d], e' at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def describe_types(types: Sequence[str]) -> str:
    """['<class \\'int\\'>', "typing.Literal['a', 'b']", ...] -> 'one of: a, b or an integer'."""
    values: list[str] = []
    kinds: list[str] = []
    for t in types:
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", t.strip())
        if literal:
            values += [v.strip().strip("'\"") for v in split_top_level(literal.group(1))]
            continue
        cls = re.fullmatch(r"<class '([\w.]+)'>", t.strip())
        name = cls.group(1) if cls else t.strip()
        kinds.append(TYPE_WORDS.get(name, name.rsplit(".", 1)[-1]))
    parts = [f"one of: {', '.join(dict.fromkeys(values))}"] if values else []
    parts += list(dict.fromkeys(kinds))
    return " or ".join(parts)


def _dedent(lines: list[str]) -> list[str]:
    return textwrap.dedent("\n".join(lines)).splitlines()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _closest(name: str, known: Sequence[str], cutoff: float = 0.6) -> str | None:
    close = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    return close[0] if close else None


def _did_you_mean(name: str, known: Sequence[str], prefix: str = "--") -> str:
    """'; did you mean --data.num_clients?' (an option, with `prefix`), "; did you mean
    'data.num_clients'?" (a config file's key, no prefix), or '' when nothing is close."""
    close = _closest(name, known)
    if not close:
        return ""
    return f"; did you mean {prefix}{close}?" if prefix else f"; did you mean '{close}'?"


def closest_method(name: str, methods: Sequence[str]) -> str | None:
    """The method `name` most likely meant: the same name in other letter case first (`fedsol`),
    else a close spelling (`FedSOLL`), else None (then every method is listed: a far guess such as
    FedProto for `FedFoo` would mislead more than the list)."""
    by_lower = {m.lower(): m for m in methods}
    close = _closest(name.lower(), list(by_lower), cutoff=0.75)
    return by_lower.get(name.lower()) or (by_lower[close] if close else None)


def unknown_method(name: str, methods: Sequence[str], option: str = "--model") -> str:
    meant = closest_method(name, methods)
    if meant:
        return f"{option} {name}: unknown method; did you mean {meant}? (fl-lightning fit --help lists every method)"
    return f"{option} {name}: unknown method; choose one of: {', '.join(methods)} (or a full class path)"


def as_typed(key: str, args: Sequence[str] = ()) -> str:
    """The option `key` (`model.init_args.lr`, as jsonargparse names it) as the user types it:
    `--model.lr` when the command line has that short form, else `--model.init_args.lr`."""
    if not key:
        return key
    short = key.replace(".init_args.", ".", 1)
    if short != key and any(a == f"--{short}" or a.startswith(f"--{short}=") for a in args):
        return f"--{short}"
    return f"--{key}"


def _explain(block: list[str], key: str, class_options: Callable[[str], list[str]], args: Sequence[str] = ()) -> str:
    """One jsonargparse report about `key` (its lines dedented) -> one line."""
    block = [line for line in block if line.strip()]
    option = as_typed(key.rstrip("."), args)
    if not block:
        return f"{option}: invalid value"
    head = block[0].strip()
    nested = re.match(r'Parser key "([^"]+)":\s*(.*)', head)
    if nested:
        inner_key = f"{key}{nested.group(1)}" if key.endswith(".") else nested.group(1)
        rest = [nested.group(2)] if nested.group(2) else []
        return _explain(rest + _dedent(block[1:]), inner_key, class_options, args)
    for i, line in enumerate(block):
        problem = re.match(r"\s*- Problem with given class_path '([^']+)':\s*$", line)
        if problem:
            inner = []
            for following in block[i + 1 :]:
                if _indent(following) <= _indent(line):
                    break
                inner.append(following)
            return _explain_class(problem.group(1), _dedent(inner), key, class_options, args)
    if head.startswith("Does not validate against any of the Union subtypes"):
        text = "\n".join(block)
        subtypes = re.search(r"^\s*Subtypes: \[(.*)\]\s*$", text, re.M)
        given = re.search(r"^\s*Given value: (.*)$", text, re.M)
        expected = describe_types(split_top_level(subtypes.group(1))) if subtypes else "another value"
        return f"{option}: got '{given.group(1).strip() if given else '?'}'; expected {expected}"
    expected = re.match(r"Expected a (.+?)\. Got value: (.*)$", head)
    if expected:
        return f"{option}: got '{expected.group(2).strip()}'; expected {describe_types([expected.group(1)])}"
    missing_file = re.match(r"File does not exist: '?([^']+)'?", head)
    if missing_file and key == "config":
        return f"config file {missing_file.group(1)} does not exist"
    return (f"{option}: " if option else "") + " ".join(line.strip(" -") for line in block[:2])


# Options that were renamed, by method: the old name gets a line naming the new one. `server_lr`
# is the server's step size on the round's update (FedAvg, FedOpt); the learning rates of a
# server-side training have names of their own.
RENAMED_OPTIONS = {
    "FedTGP": {"server_lr": "proto_lr (the learning rate of the server's prototype training)"},
    "FedORGP": {"server_lr": "proto_lr (the learning rate of the server's prototype training)"},
    "FedGH": {"server_lr": "head_lr (the learning rate of the server's head training)"},
}


def _explain_class(class_path: str, inner: list[str], key: str, class_options: Callable[[str], list[str]],
                   args: Sequence[str] = ()) -> str:
    name = class_path.rsplit(".", 1)[-1]
    head = inner[0].strip() if inner else ""
    unknown = re.match(r"Option '([^']+)' is not accepted", head)
    if unknown:
        option = unknown.group(1)
        typed = as_typed(f"{key}.init_args.{option}", args)
        renamed = RENAMED_OPTIONS.get(name, {}).get(option)
        if renamed:
            return f"{typed}: {name}'s option is now {renamed}"
        known = class_options(class_path)
        hint = _did_you_mean(option, known, prefix=typed[: -len(option)])
        listed = f" ({name}'s options: {', '.join(known)})" if known and not hint else ""
        return f"{typed}: {name} has no option '{option}'{hint}{listed}"
    return f"{_explain(inner, f'{key}.init_args.', class_options, args)} ({name})"


def bad_config_file(config_files: Sequence[str]) -> str | None:
    """Which --config file is not a YAML mapping of sections, and how."""
    import yaml

    for path in config_files:
        p = Path(path)
        if not p.is_file():
            continue
        try:
            content = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            return f"config file {path} is not valid YAML: {problem}{where}"
        except (OSError, UnicodeDecodeError) as err:
            return f"config file {path} cannot be read: {err}"
        if content is None:
            return f"config file {path} is empty; a config is a YAML mapping of sections ({CONFIG_SECTIONS})"
        if not isinstance(content, dict):
            return (f"config file {path} holds a {type(content).__name__}, not a mapping of sections "
                    f"({CONFIG_SECTIONS})")
    return None


def config_files(args: Sequence[str]) -> list[str]:
    files = []
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def summarise(text: str, args: Sequence[str] = (), option_names: Sequence[str] = (),
              class_options: Callable[[str], list[str]] = lambda class_path: [],
              methods: Sequence[str] = ()) -> str:
    """jsonargparse's report `text` -> one line. `args` is the command line (to find a broken
    --config file), `option_names` the subcommand's options (for a did-you-mean),
    `class_options(class_path)` a class's init options, `methods` the concrete method names."""
    lines = text.strip("\n").splitlines()
    first = lines[0].strip() if lines else ""
    if first.startswith(("Unexpected config", "Problems parsing config")):
        culprit = bad_config_file(config_files(args))
        if culprit:
            return culprit
        return f"a config must be a YAML mapping of sections ({CONFIG_SECTIONS}); got: {' '.join(first.split())}"
    unknown = re.match(r"Subcommand '(\w+)' does not accept option '([^']+)'", first)
    if unknown:  # a key of a config file: named as the file writes it
        option = unknown.group(2)
        hint = _did_you_mean(option, option_names, prefix="")
        if not hint and "." not in option:
            hint = f"; the sections are {CONFIG_SECTIONS}"
        return f"unknown option '{option}'{hint} (see fl-lightning {unknown.group(1)} --help)"
    unrecognised = re.match(r"unrecognized arguments: (.+)", first)
    if unrecognised:
        option = unrecognised.group(1).split()[0].split("=", 1)[0]
        hint = _did_you_mean(option.lstrip("-"), option_names, prefix="--" if option.startswith("--") else "")
        return f"unknown option {option}{hint} (see fl-lightning fit --help)"
    no_subcommand = re.match(r'expected "subcommand" to be one of \{([^}]*)\}', first)
    if no_subcommand:
        choices = [*no_subcommand.group(1).split(","), "sweep", "report"]
        given = re.search(r'got value "([^"]+)"|but it was not provided', first)
        what = f"unknown subcommand '{given.group(1)}'" if given and given.group(1) else "no subcommand given"
        return (f"{what}; choose one of: {', '.join(choices)} "
                f"(e.g. fl-lightning fit --config configs/settings/mnist5k.yaml)")
    bad_choice = re.search(r"argument subcommand: invalid choice: '([^']+)' \(choose from (.*)\)", text)
    if bad_choice:
        choices = [*(c.strip(" '") for c in bad_choice.group(2).split(",")), "sweep", "report"]
        return f"unknown subcommand '{bad_choice.group(1)}'; choose one of: {', '.join(choices)}"
    # an unknown name, or an abstract base (jsonargparse does not accept those as a class path)
    missing_class = re.search(r"(?:Expected a dot import path string: |Expected a path but )(\S+)", text)
    if missing_class and first.startswith('Parser key "model"'):
        return unknown_method(missing_class.group(1), methods)
    help_of = re.match(r"(--model\.help): Expected a dot import path string: (\S+)", first)
    if help_of:
        return unknown_method(help_of.group(2), methods, option=help_of.group(1))
    return _explain(lines, "", class_options, args)
