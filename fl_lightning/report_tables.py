"""How `fl-lightning report` prints its table: markdown for the terminal, LaTeX for a paper.

The LaTeX table is a `booktabs` tabular (`\\toprule`, `\\midrule`, `\\bottomrule`; add
`\\usepackage{booktabs}` to the paper's preamble) of the same cells as the markdown table, `±` as
`$\\pm$`, and in each accuracy column the best mean of each setting in bold (`\\textbf{}`): every
row whose mean, as printed, is the highest, where at least two rows have one. It is written here
rather than through pandas' `Styler.to_latex`: the package does not depend on pandas, and the
cells, already text, need only their special characters escaped.
"""

from __future__ import annotations

# LaTeX's special characters and the characters the cells use that a LaTeX font may lack
_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
          "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "−": "$-$",
          "—": "---", "–": "--"}


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def escape(text: str) -> str:
    """`text` as LaTeX prints it; the sign of a negative number (`-1.01`, `[-5.29`) as a minus
    sign, not the hyphen that LaTeX's text mode makes of `-`."""
    def char(i: int, c: str) -> str:
        if c == "-" and text[i + 1:i + 2].isdigit() and not (i and (text[i - 1].isalnum() or text[i - 1] in "._")):
            return "$-$"
        return _LATEX.get(c, c)

    return "".join(char(i, c) for i, c in enumerate(text))


def best_cells(means: list[dict[int, float]], groups: list[str]) -> set[tuple[int, int]]:
    """(row, column) of the best mean of each column within each group (a setting: rows of two
    settings are not compared), as printed (two decimals: a tie reads as one); none where fewer
    than two rows of a group have a mean in that column."""
    best = set()
    for group in set(groups):
        rows = [i for i, g in enumerate(groups) if g == group]
        for column in {c for i in rows for c in means[i]}:
            printed = {i: round(means[i][column], 2) for i in rows if column in means[i]}
            if len(printed) >= 2:
                top = max(printed.values())
                best |= {(i, column) for i, v in printed.items() if v == top}
    return best


def latex(headers: list[str], rows: list[list[str]], labels: int, bold: set[tuple[int, int]] = frozenset()) -> str:
    """A booktabs tabular: the first `labels` columns left-aligned (the rows' labels), the
    figures right-aligned; the cells of `bold` (row, column) in bold."""
    def line(cells: list[str]) -> str:
        return " & ".join(cells) + r" \\"

    body = [line([rf"\textbf{{{escape(c)}}}" if (i, j) in bold else escape(c) for j, c in enumerate(row)])
            for i, row in enumerate(rows)]
    spec = "l" * labels + "r" * (len(headers) - labels)
    return "\n".join([rf"\begin{{tabular}}{{{spec}}}", r"\toprule", line([escape(h) for h in headers]), r"\midrule",
                      *body, r"\bottomrule", r"\end{tabular}"])


def comment(text: str) -> str:
    """Lines LaTeX skips (`% ...`), so that the printed table can be pasted or redirected whole."""
    return "\n".join(f"% {line}" if line else "%" for line in text.splitlines())


def published_text(entry: dict) -> str:
    """A paper table's entry as the paper prints it: `acc ± std`, or the paper's `(Failed)`."""
    acc, std = entry.get("acc"), entry.get("std")
    if entry.get("failed"):
        return f"{acc:.2f} (Failed)" if acc is not None else "(Failed)"
    if acc is None:
        return "—"
    return f"{acc:.2f}" + (f" ± {std:.2f}" if std is not None else "")
