"""The studies beyond the paper, each one module behind one interface
(:class:`~pmnet.report.studies.study.Study`): how it recognises its results, and what it
adds to the report (:class:`~pmnet.report.studies.study.Findings`: tables, figures,
comparison families, data files, missing-results lines).

:func:`pmnet.report.build_report` builds the paper's own tables, then asks every study of
:data:`STUDIES`, in this order, whether the trials hold its results. A new study is a new
module here with a ``STUDY`` and one line below (docs/design.md, "Adding a study").
"""

from pmnet.report.studies import (
    baselines,
    checkpoints,
    operators,
    routes,
    segments,
    selected_vs_last,
)
from pmnet.report.studies.study import Findings, Study

#: Every study, in the order its tables and figures follow the paper's.
STUDIES: tuple[Study, ...] = (
    selected_vs_last.STUDY,
    operators.STUDY,
    checkpoints.STUDY,
    routes.STUDY,
    segments.STUDY,
    baselines.STUDY,
)

__all__ = ["STUDIES", "Findings", "Study"]
