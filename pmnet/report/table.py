"""A report table (:class:`Table`): the paper's label, caption, columns, rows of cells and
footnotes, rendered to Markdown, LaTeX or HTML."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from pmnet.report.cells import MISSING, Cell, escape, format_cell, tex_escape, text_cell


@dataclass
class Table:
    """A rendered-on-demand table: ``id`` is the paper's label (``tab:...``)."""

    id: str
    caption: str
    columns: list[str]
    rows: list[list[Cell]]
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    rules_before: set[int] = field(default_factory=set)
    #: LaTeX column specs (``l``, ``r``, ``p{4cm}``); Markdown alignment follows them, and a
    #: ``p{...}`` column wraps its text in HTML too.
    align: list[str] | None = None

    def __post_init__(self) -> None:
        self.rows = [[c if isinstance(c, Cell) else text_cell(c) for c in row] for row in self.rows]
        if self.align is None:
            self.align = ["l"] + ["r"] * (len(self.columns) - 1)
        if len(self.align) != len(self.columns):
            raise ValueError(f"table {self.id}: {len(self.align)} alignments for "
                             f"{len(self.columns)} columns")
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.id}: row has {len(row)} cells for {len(self.columns)} columns"
                )

    def footnotes(self) -> list[str]:
        out = list(self.notes)
        if self.missing:
            out.append(f"{MISSING} = missing. " + "; ".join(self.missing) + ".")
        return out

    def to_markdown(self) -> str:
        lines = [f"**Table `{self.id}`.** {escape(self.caption, 'md')}", ""]
        lines.append("| " + " | ".join(escape(c, "md") for c in self.columns) + " |")
        aligns = [{"r": "---:", "c": ":---:"}.get(a[0], ":---") for a in self.align or []]
        lines.append("| " + " | ".join(aligns) + " |")
        for row in self.rows:
            lines.append("| " + " | ".join(format_cell(c, "md") for c in row) + " |")
        notes = self.footnotes()
        if notes:
            lines.append("")
            lines += [f"- {escape(n, 'md')}" for n in notes]
        return "\n".join(lines) + "\n"

    def to_latex(self) -> str:
        spec = "@{}" + "".join(self.align or []) + "@{}"
        lines = [
            r"\begin{table}[htbp]",
            r"\centering",
            rf"\caption{{{tex_escape(self.caption)}}}",
            rf"\label{{{self.id}}}",
            r"\scriptsize",
            rf"\begin{{tabular}}{{{spec}}}",
            r"\toprule",
            " & ".join(tex_escape(c) for c in self.columns) + r" \\",
            r"\midrule",
        ]
        for i, row in enumerate(self.rows):
            if i in self.rules_before:
                lines.append(r"\midrule")
            lines.append(" & ".join(format_cell(c, "tex") for c in row) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"]
        for note in self.footnotes():
            lines.append(r"\par\smallskip{\footnotesize " + tex_escape(note) + "}")
        lines.append(r"\end{table}")
        return "\n".join(lines) + "\n"

    def to_html(self) -> str:
        out = [f'<table id="{html.escape(self.id)}">']
        out.append(
            f"<caption><code>{html.escape(self.id)}</code> {html.escape(self.caption)}</caption>"
        )
        out.append(
            "<thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
            + "</tr></thead>"
        )
        out.append("<tbody>")
        for i, row in enumerate(self.rows):
            cls = ' class="rule"' if i in self.rules_before else ""
            cells = []
            for j, cell in enumerate(row):
                tag = "th" if j == 0 else "td"
                classes = " ".join(c for c, on in (
                    ("missing", cell.is_missing and cell.kind != "na"),
                    ("wrap", (self.align or [])[j].startswith("p"))) if on)
                attr = f' class="{classes}"' if classes else ""
                cells.append(f"<{tag}{attr}>{format_cell(cell, 'html')}</{tag}>")
            out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
        out.append("</tbody></table>")
        for note in self.footnotes():
            out.append(f'<p class="note">{html.escape(note)}</p>')
        return "\n".join(out) + "\n"

    def render(self, target: str) -> str:
        return {"md": self.to_markdown, "tex": self.to_latex, "html": self.to_html}[target]()
