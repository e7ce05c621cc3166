"""Tables, figures and the HTML/Markdown report built from Phase-2 trial results.

Tables follow the paper's layout (same rows, columns and labels, e.g.
``tab:direct-ltm-routing``); each aggregate cell is "mean ± SD" from our trials, followed in
parentheses by the paper's value where the paper has one (printed in paper-aggregates.csv, or
derived from paper-per-seed.csv with the same statistics). A missing trial or metric renders
as "—" and the table's footnote names it; a cell over fewer seeds than expected carries
"[n=k]".

Figures use matplotlib's object-oriented API on the Agg canvas (no pyplot, no display), and
a figure whose data is missing is skipped with a note instead of failing.

:func:`build_report` writes one self-contained HTML page (inline CSS, figures as base64 PNG;
it opens with a figure of our recall beside the paper's and the output-set baseline, then a
verdict in three sentences, then the tables) and a Markdown twin (figures linked as files,
without that opening) plus the tables (.md/.tex), the figures (.png/.pdf) and the tidy data
(.csv/.parquet); :func:`main_report` does it for a pipeline run directory
(``RUN_DIR/results/*.json`` -> ``RUN_DIR/report/``).

Modules (each imports only those above it):

================  ========================================================================
``cells``         :class:`Cell` and its Markdown / LaTeX / HTML markup
``table``         :class:`Table`
``context``       frame -> cells (:class:`Context`), the missing trials behind them
``paper_tables``  the paper's tables, headline, claims, the paper's paired comparisons
``figures``       the paper's figures, training curves, saving
``facts``         "What ran" and "Missing results"
``page``          the HTML page and its Markdown twin
``trials``        :class:`Trials`: the trials of a report, scoped for the paper's tables
``front``         what the page opens with: the recall figure and the three-sentence verdict
``studies``       the studies beyond the paper, one module each behind one interface
``build``         :func:`build_report`, :func:`main_report`
================  ========================================================================
"""

from pmnet.report.build import build_report, build_tables, main_report
from pmnet.report.cells import (
    MISSING,
    NA,
    TARGETS,
    Cell,
    format_cell,
    format_p,
    tex_escape,
    text_cell,
)
from pmnet.report.context import PAPER_NOTE, Context
from pmnet.report.facts import _grid_from_meta, _pipeline_facts, _run_facts, missing_results
from pmnet.report.figures import (
    FigureResult,
    figure_bytes,
    figure_training_curves,
    make_figures,
    paper_figures,
    save_figure,
)
from pmnet.report.page import RAW_RECORDS
from pmnet.report.studies import STUDIES, Findings, Study
from pmnet.report.studies.operators import table_operator_comparisons, table_operators
from pmnet.report.studies.routes import routes_frame, table_routes
from pmnet.report.studies.segments import build_segment_tables, figure_segments
from pmnet.report.table import Table
from pmnet.report.trials import Trials
from pmnet.stats import condition_label

__all__ = [
    "MISSING", "NA", "TARGETS", "Cell", "format_cell", "format_p", "tex_escape", "text_cell",
    "Table", "Context", "PAPER_NOTE", "Trials", "STUDIES", "Study", "Findings",
    "FigureResult", "figure_bytes", "figure_training_curves", "make_figures", "paper_figures",
    "save_figure", "figure_segments", "build_segment_tables", "table_operators",
    "table_operator_comparisons", "table_routes", "routes_frame",
    "build_tables", "build_report", "main_report", "missing_results",
    "RAW_RECORDS", "condition_label", "_grid_from_meta", "_pipeline_facts", "_run_facts",
]
