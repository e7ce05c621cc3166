"""A report table (:class:`Table`): the paper's label, caption, columns, rows of cells and
footnotes, rendered to Markdown, LaTeX or HTML.

The page shows only what ran (issue 35): :meth:`Table.prune` drops a row with no value of
ours (every cell outside the label and aside columns missing or blank). A long text cell
(a per-row note) becomes a numbered footnote: the cell shows its number, the text follows
the table (:data:`FOOTNOTE_CHARS`)."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from pmnet.report.cells import MISSING, Cell, escape, format_cell, tex_escape, text_cell

#: A text cell longer than this, outside the label columns and the columns that wrap
#: (``p{...}``), becomes a numbered footnote, so that no table is wider than the page.
FOOTNOTE_CHARS = 40


#: an identifier of at least this many characters (``consolidator_only_routing_off``) may
#: wrap after its underscores on the page
LONG_NAME = re.compile(r"\b\w*_\w*\b")
LONG_NAME_CHARS = 16


def breakable(markup: str) -> str:
    """HTML text with a line-break opportunity (``<wbr>``) after each underscore of a long
    identifier, so that a header, a row label or a text cell that names one can wrap where
    its column is narrower than the name; it reads the same."""
    return LONG_NAME.sub(lambda m: m.group(0).replace("_", "_<wbr>")
                         if len(m.group(0)) >= LONG_NAME_CHARS else m.group(0), markup)


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
    #: the leading columns that name a row (row headers in HTML), not values
    labels: int = 1
    #: columns that are not our values: the paper's, a verdict, a note (``aside`` in HTML)
    asides: set[int] = field(default_factory=set)
    #: the conditions without any trial behind the rows :meth:`prune` left out (a table
    #: left with no row is not printed; the report names it and these instead)
    absent: list[str] = field(default_factory=list)

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

    # only what ran ------------------------------------------------------------------------
    def is_value(self, j: int, cell: Cell) -> bool:
        """Whether cell ``cell`` of column ``j`` is a value of ours: outside the label and
        aside columns, not missing, not blank."""
        if j < self.labels or j in self.asides or cell.kind == "na" or cell.is_missing:
            return False
        return cell.kind != "text" or cell.text.strip() not in ("", MISSING)

    def has_value(self, row: list[Cell]) -> bool:
        return any(self.is_value(j, c) for j, c in enumerate(row))

    def drop_empty_column(self, name: str) -> bool:
        """Remove the column named `name` when no row has a cell there (every one missing or
        n/a: the input lacks what it shows); True when it was removed."""
        j = self.columns.index(name)
        if any(row[j].kind != "na" and not row[j].is_missing for row in self.rows):
            return False
        del self.columns[j], self.align[j]
        for row in self.rows:
            del row[j]
        self.asides = {a - (a > j) for a in self.asides if a != j}
        return True

    def prune(self) -> list[list[Cell]]:
        """Drop the rows without a value of ours (the horizontal rules follow the rows that
        stay); returns the dropped rows."""
        keep = [i for i, row in enumerate(self.rows) if self.has_value(row)]
        if len(keep) == len(self.rows):
            return []
        dropped = [row for i, row in enumerate(self.rows) if i not in set(keep)]
        rules = set()
        for new, old in enumerate(keep):
            if new and any(keep[new - 1] < r <= old for r in self.rules_before):
                rules.add(new)
        self.rows = [self.rows[i] for i in keep]
        self.rules_before = rules
        return dropped

    def row_name(self, row: list[Cell]) -> str:
        """A row as its label columns read (``Learned full 42``)."""
        return " ".join(c.text for c in row[:self.labels] if c.kind == "text" and c.text)

    # numbered footnotes -------------------------------------------------------------------
    def numbered(self) -> tuple[dict[tuple[int, int], int], list[str]]:
        """The long text cells that become footnotes: {(row, column): number} and the texts
        in number order (a text repeated in several rows has one number)."""
        marks: dict[tuple[int, int], int] = {}
        texts: list[str] = []
        for i, row in enumerate(self.rows):
            for j, cell in enumerate(row):
                if (j < self.labels or (self.align or [])[j].startswith("p")
                        or cell.kind != "text" or len(cell.text) <= FOOTNOTE_CHARS):
                    continue
                if cell.text not in texts:
                    texts.append(cell.text)
                marks[(i, j)] = texts.index(cell.text) + 1
        return marks, texts

    def to_markdown(self) -> str:
        lines = [f"**Table `{self.id}`.** {escape(self.caption, 'md')}", ""]
        lines.append("| " + " | ".join(escape(c, "md") for c in self.columns) + " |")
        aligns = [{"r": "---:", "c": ":---:"}.get(a[0], ":---") for a in self.align or []]
        lines.append("| " + " | ".join(aligns) + " |")
        marks, texts = self.numbered()
        for i, row in enumerate(self.rows):
            lines.append("| " + " | ".join(
                f"[{marks[(i, j)]}]" if (i, j) in marks else format_cell(c, "md")
                for j, c in enumerate(row)) + " |")
        notes = [escape(n, "md") for n in self.footnotes()]
        notes += [f"[{k}] {escape(t, 'md')}" for k, t in enumerate(texts, 1)]
        if notes:
            lines.append("")
            lines += [f"- {n}" for n in notes]
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
        marks, texts = self.numbered()
        for i, row in enumerate(self.rows):
            if i in self.rules_before:
                lines.append(r"\midrule")
            lines.append(" & ".join(
                rf"\textsuperscript{{{marks[(i, j)]}}}" if (i, j) in marks
                else format_cell(c, "tex") for j, c in enumerate(row)) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"]
        notes = [tex_escape(n) for n in self.footnotes()]
        notes += [rf"\textsuperscript{{{k}}}{tex_escape(t)}" for k, t in enumerate(texts, 1)]
        for note in notes:
            lines.append(r"\par\smallskip{\footnotesize " + note + "}")
        lines.append(r"\end{table}")
        return "\n".join(lines) + "\n"

    def to_html(self) -> str:
        out = [f'<table id="{html.escape(self.id)}">']
        out.append(
            f"<caption><code>{html.escape(self.id)}</code> {html.escape(self.caption)}</caption>"
        )
        out.append(
            "<thead><tr>" + "".join(f"<th>{breakable(html.escape(c))}</th>"
                                    for c in self.columns)
            + "</tr></thead>"
        )
        out.append("<tbody>")
        marks, texts = self.numbered()
        for i, row in enumerate(self.rows):
            cls = ' class="rule"' if i in self.rules_before else ""
            cells = []
            for j, cell in enumerate(row):
                tag = "th" if j < self.labels else "td"
                classes = " ".join(c for c, on in (
                    ("missing", cell.is_missing and cell.kind != "na"),
                    ("wrap", (self.align or [])[j].startswith("p")),
                    # text may wrap at its spaces where the table is wider than the page;
                    # numbers keep to one line
                    ("text", cell.kind == "text" and j >= self.labels
                     and not (self.align or [])[j].startswith("p")),
                    ("aside", j in self.asides and j >= self.labels),
                    ("pair", cell.paper is not None and not cell.paper.is_missing)) if on)
                attr = f' class="{classes}"' if classes else ""
                body = (f'<sup class="fn">{marks[(i, j)]}</sup>' if (i, j) in marks
                        else format_cell(cell, "html"))
                if cell.kind == "text" and cell.paper is None:
                    body = breakable(body)
                cells.append(f"<{tag}{attr}>{body}</{tag}>")
            out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
        out.append("</tbody></table>")
        for note in self.footnotes():
            out.append(f'<p class="note">{html.escape(note)}</p>')
        for k, text in enumerate(texts, 1):
            out.append(f'<p class="note fn"><sup>{k}</sup> {html.escape(text)}</p>')
        return "\n".join(out) + "\n"

    def render(self, target: str) -> str:
        return {"md": self.to_markdown, "tex": self.to_latex, "html": self.to_html}[target]()
