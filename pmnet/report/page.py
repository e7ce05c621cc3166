"""The report's two pages: one self-contained HTML page (inline CSS, figures as base64
PNG) and its Markdown twin (figures linked as files)."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pmnet.report.facts import _meta_value
from pmnet.report.figures import FigureResult
from pmnet.report.table import Table

DESCRIPTIVE_NOTE = (
    "With n = 5 seeds (or fewer), the 95% confidence intervals and paired t-tests are "
    "descriptive, as the paper says (Sections 6.3 and 9). All main seeds share one Phase-1 "
    "checkpoint, so their spread reflects consolidation training and data streams only."
)
#: the same note when the headline reads K >= 2 Phase-1 checkpoints (issue 35)
UNIT_NOTE = (
    "The headline and claims read every Phase-1 checkpoint: their CIs and p values are the "
    "mixed model's over checkpoints (t with K - 1 df), so with few checkpoints they are wide "
    "(tab:checkpoint-distribution, where present, says how many a decision needs). Within "
    "one checkpoint, tests over n = 5 seeds (or fewer) are descriptive, as the paper says "
    "(Sections 6.3 and 9), and speak for that checkpoint only."
)


def statistics_note(by_id: Mapping[str, Table]) -> str:
    headline = by_id.get("tab:headline")
    unit = headline is not None and "Per checkpoint" in headline.columns
    return UNIT_NOTE if unit else DESCRIPTIVE_NOTE


#: A hexadecimal run this long (a sha256, a commit) is shown as its first HASH_CHARS digits
#: and "…" on the page; data/run_records.json holds it whole.
LONG_HEX = re.compile(r"\b[0-9a-f]{16,}\b")
HASH_CHARS = 12
#: An absolute path of more than two parts is shown as "…/" and its last two parts.
LONG_PATH = re.compile(r"(?<![\w.~])/(?:[^/\s\"',;()]+/)+([^/\s\"',;()]+/[^/\s\"',;()]+)")
#: A raw record longer than this is cut on the page ("… whole in data/run_records.json").
RECORD_CHARS = 400


def shorten(text: str) -> str:
    """A value as the page shows it (issue 35): hashes to HASH_CHARS hex digits + "…",
    absolute paths to their last two parts (``…/phase1/phase1.pt``)."""
    text = LONG_HEX.sub(lambda m: m.group(0)[:HASH_CHARS] + "…", text)
    return LONG_PATH.sub(lambda m: "…/" + m.group(1), text)


def _record(value: Any) -> str:
    text = shorten(_meta_value(value))
    if len(text) > RECORD_CHARS:
        text = text[:RECORD_CHARS].rstrip() + f" … (whole in data/{RAW_RECORDS})"
    return text


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:1em 0;font-size:.85em}
caption{caption-side:top;text-align:left;font-weight:600;padding:.3em 0}
th,td{border-top:1px solid #ddd;border-bottom:1px solid #ddd;padding:.25em .6em;text-align:right;
white-space:nowrap}
thead th{border-bottom:2px solid #444;text-align:center;white-space:normal;vertical-align:bottom}
tbody th{text-align:left;font-weight:normal;white-space:normal;min-width:6em}
td.text{white-space:normal}
td.pair{white-space:normal}.ours,.paper{white-space:nowrap}
td.aside{color:#444}sup.fn{color:#555}p.fn sup{font-weight:600}
tr.rule{border-top:2px solid #888}
td.missing,th.missing{color:#b00}
td.wrap,th.wrap{white-space:normal;min-width:12em}
.paper{color:#666;font-size:.9em}
.note{font-size:.85em;color:#444;margin:.2em 0}
.skipped{color:#a40;font-style:italic}
figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#444}
p.verdict{font-size:1.05em;margin:1em 0 1.5em}
code{background:#f4f4f4;padding:0 .2em}
dl.meta dt{font-weight:600}dl.meta dd{margin:0 0 .4em 1.2em;font-family:monospace;
overflow-wrap:anywhere}
table.facts th{text-align:left;padding-right:1em;white-space:nowrap;vertical-align:top}
table.facts td{text-align:left;white-space:normal;overflow-wrap:anywhere}
"""


FRONT_TABLES = ("tab:headline", "tab:claims")


def _figure_html(fig: FigureResult, figure_data: Mapping[str, bytes], front: bool = False
                 ) -> str:
    """A figure as an inline PNG with its caption; a skipped one as a line that says why (the
    ``front`` figure: as a figure that says why, so that the page still opens with it)."""
    esc = html.escape
    if fig.id not in figure_data:
        if front:
            return (f'<figure id="{esc(fig.id)}" class="skipped"><figcaption>Figure skipped: '
                    f"{esc(fig.title)} ({esc(fig.skipped or 'no data')}).</figcaption>"
                    "</figure>")
        return (f'<p class="skipped" id="{esc(fig.id)}">Figure skipped: '
                f"{esc(fig.title)} ({esc(fig.skipped or 'no data')}).</p>")
    data = base64.b64encode(figure_data[fig.id]).decode("ascii")
    caption = fig.caption + ("" if not fig.notes else " " + "; ".join(fig.notes) + ".")
    return "\n".join([
        f'<figure id="{esc(fig.id)}">',
        f'<img src="data:image/png;base64,{data}" alt="{esc(fig.title)}">',
        f"<figcaption><strong>{esc(fig.title)}.</strong> {esc(caption)}</figcaption></figure>"])


#: The pipeline's raw records (pipeline.json, timing, Stage 1), under the report's data/.
RAW_RECORDS = "run_records.json"


def html_page(
    meta: Mapping[str, Any],
    facts: Sequence[tuple[str, str]],
    tables: Sequence[Table],
    figures: Sequence[FigureResult],
    figure_data: Mapping[str, bytes],
    missing: Sequence[str],
    notes: Sequence[str],
    not_printed: Sequence[str] = (),
    *,
    front: FigureResult | None = None,
    verdict: Sequence[str] = (),
) -> str:
    """The page. ``front`` (with its PNG in ``figure_data``) and ``verdict``: what a person
    reads first (issue 64), the figure right under the title, the verdict's sentences under
    it, then the notes and the tables."""
    esc = html.escape
    by_id = {t.id: t for t in tables}
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>PMNet Consolidator reproduction report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>PMNet Consolidator: reproduction report</h1>",
    ]
    if front is not None:
        out.append(_figure_html(front, figure_data, front=True))
    if verdict:
        out.append(f'<p id="verdict" class="verdict">{esc(" ".join(verdict))}</p>')
    out.append(f'<p class="note">Generated '
               f'{esc(_dt.datetime.now().isoformat(timespec="seconds"))}.</p>')
    for note in notes:
        out.append(f'<p class="note">{esc(note)}</p>')
    if "tab:headline" in by_id:
        out.append('<h2 id="headline">Headline numbers</h2>')
        out.append(by_id["tab:headline"].to_html())
    out.append(f'<p class="note"><strong>Statistics.</strong> {esc(statistics_note(by_id))}'
               '</p>')
    if "tab:claims" in by_id:
        out.append('<h2 id="claims">Which claims reproduce</h2>')
        out.append(by_id["tab:claims"].to_html())
    out.append('<h2 id="what-ran">What ran</h2><table class="facts"><tbody>')
    for key, value in facts:
        out.append(f"<tr><th>{esc(key)}</th><td>{esc(shorten(str(value)))}</td></tr>")
    out.append("</tbody></table>")
    out.append('<h2 id="tables">Tables</h2>')
    for line in not_printed:
        out.append(f'<p class="note not-printed">{esc(line)}</p>')
    for table in tables:
        if table.id not in FRONT_TABLES:
            out.append(table.to_html())
    out.append('<h2 id="figures">Figures</h2>')
    for fig in figures:
        out.append(_figure_html(fig, figure_data))
    out.append('<h2 id="missing-results">Missing results</h2>')
    if missing:
        out.append("<ul>" + "".join(f"<li>{esc(m)}</li>" for m in missing) + "</ul>")
    else:
        out.append("<p>None: every expected trial and key metric is present.</p>")
    out.append('<h2 id="raw-records">Raw records</h2>')
    out.append(f'<p class="note">Also in <code>data/{RAW_RECORDS}</code>.</p><dl class="meta">')
    for key, value in meta.items():
        out.append(f"<dt>{esc(str(key))}</dt><dd>{esc(_record(value))}</dd>")
    out.append("</dl>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def markdown_page(
    meta: Mapping[str, Any],
    facts: Sequence[tuple[str, str]],
    tables: Sequence[Table],
    figures: Sequence[FigureResult],
    figure_files: Mapping[str, str],
    missing: Sequence[str],
    notes: Sequence[str],
    not_printed: Sequence[str] = (),
) -> str:
    by_id = {t.id: t for t in tables}
    out = ["# PMNet Consolidator: reproduction report", ""] + [f"> {n}" for n in notes]
    out += [""]
    if "tab:headline" in by_id:
        out += ["## Headline numbers", "", by_id["tab:headline"].to_markdown()]
    out += [f"**Statistics.** {statistics_note(by_id)}", ""]
    if "tab:claims" in by_id:
        out += ["## Which claims reproduce", "", by_id["tab:claims"].to_markdown()]
    out += ["## What ran", "", "| | |", "|---|---|"]
    out += [f"| {key} | {shorten(str(value)).replace('|', '/')} |" for key, value in facts]
    out += ["", "## Tables", ""] + [f"{line}\n" for line in not_printed]
    for table in tables:
        if table.id not in FRONT_TABLES:
            out += [table.to_markdown()]
    out += ["## Figures", ""]
    for fig in figures:
        if fig.id in figure_files:
            caption = fig.caption + ("" if not fig.notes else " " + "; ".join(fig.notes) + ".")
            pdf = Path(figure_files[fig.id]).with_suffix(".pdf").as_posix()
            out += [f"![{fig.title}]({figure_files[fig.id]})", "",
                    f"*{fig.title}.* {caption} (PDF: `{pdf}`)", ""]
        else:
            out += [f"*Figure skipped: {fig.title} ({fig.skipped or 'no data'}).*", ""]
    out += ["## Missing results", ""]
    out += [f"- {m}" for m in missing] if missing else [
        "None: every expected trial and key metric is present."]
    out += ["", "## Raw records", "",
            f"The pipeline's records as they are on disk: `data/{RAW_RECORDS}`."]
    return "\n".join(out) + "\n"
