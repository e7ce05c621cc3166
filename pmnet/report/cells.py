"""Table cells (:class:`Cell`: a statistic, number, p, CI or text, with the paper's value
beside it) and their Markdown, LaTeX and HTML markup."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

MISSING = "—"


TARGETS = ("md", "tex", "html")


def finite(value: Any) -> bool:
    if value is None:
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Cell:
    """One table cell. ``kind``: stat (mean ± SD), num, int, p, ci, text, na (not
    applicable: blank, or ``text`` saying why), missing.

    ``paper`` is the paper's value for the same cell (shown in parentheses) or None.
    """

    kind: str
    value: float = math.nan
    sd: float = math.nan
    hi: float = math.nan
    n: int | None = None
    n_expected: int | None = None
    signed: bool = False
    paper: Cell | None = None
    text: str = ""

    @property
    def is_missing(self) -> bool:
        if self.kind == "missing":
            return True
        if self.kind in ("stat", "num", "int", "p"):
            return not finite(self.value) or (self.kind == "stat" and self.n == 0)
        if self.kind == "ci":
            return not (finite(self.value) and finite(self.hi))
        return False


def text_cell(text: str) -> Cell:
    return Cell("text", text=str(text))


def na_cell(why: str) -> Cell:
    """Not applicable, saying why (``n/a: no consolidation``): not a value of ours."""
    return Cell("na", text=str(why))


NA = Cell("na")


def number(value: float, signed: bool = False, decimals: int = 2) -> str:
    value = float(value)
    if round(value, decimals) == 0:
        value = 0.0  # never print "-0.00"
    return f"{value:+.{decimals}f}" if signed else f"{value:.{decimals}f}"


def format_p(p: float, target: str = "md") -> str:
    """p to 3 significant digits; below 0.001 in scientific notation (1.07e-7 / ×10^); a p
    that underflowed to 0 as "< 1e-300"."""
    if not finite(p):
        return MISSING if target != "tex" else "---"
    if p == 0:
        return {"tex": r"\(<10^{-300}\)", "html": "&lt; 10<sup>-300</sup>"}.get(target, "< 1e-300")
    if p >= 1e-3:
        return f"{p:.3g}"
    mantissa, exponent = f"{p:.2e}".split("e")
    exp = int(exponent)
    if target == "tex":
        return rf"\({mantissa}\times10^{{{exp}}}\)"
    if target == "html":
        return f"{mantissa}×10<sup>{exp}</sup>"
    return f"{mantissa}e{exp}"


_TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"\(\pm\)",
    "—": "---",
    "–": "--",
    "−": "-",
    "→": r"\(\rightarrow\)",
    "×": r"\(\times\)",
}


def tex_escape(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in str(text))


def escape(text: str, target: str) -> str:
    if target == "tex":
        return tex_escape(text)
    if target == "html":
        return html.escape(str(text))
    return str(text).replace("|", "\\|").replace("\n", " ")


def _core(cell: Cell, target: str) -> str:
    missing = "---" if target == "tex" else MISSING
    pm = r" \(\pm\) " if target == "tex" else " ± "
    if cell.kind == "na":
        return escape(cell.text, target)
    if cell.kind == "text":
        return escape(cell.text, target)
    if cell.is_missing:
        return missing
    if cell.kind == "int":
        return str(int(round(float(cell.value))))
    if cell.kind == "num":
        return number(cell.value, cell.signed)
    if cell.kind == "p":
        return format_p(cell.value, target)
    if cell.kind == "ci":
        lo, hi = number(cell.value, True), number(cell.hi, True)
        return f"{{[}}{lo}, {hi}{{]}}" if target == "tex" else f"[{lo}, {hi}]"
    if cell.kind == "stat":
        out = number(cell.value, cell.signed)
        if finite(cell.sd):
            out += pm + number(cell.sd)
        if cell.n is not None and cell.n_expected is not None and cell.n < cell.n_expected:
            out += f" [n={cell.n}]"
        return out
    raise ValueError(f"unknown cell kind {cell.kind!r}")


def format_cell(cell: Cell | str, target: str = "md") -> str:
    """A cell as Markdown (``md``), LaTeX (``tex``) or HTML (``html``) markup."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(cell, Cell):
        cell = text_cell(cell)
    out = _core(cell, target)
    if cell.paper is not None and not cell.paper.is_missing:
        paper = _core(cell.paper, target)
        if target == "html":  # the page may break a line between ours and the paper's
            out = f'<span class="ours">{out}</span> <span class="paper">({paper})</span>'
        else:
            out += f" ({paper})"
    return out
