"""Two meshes of one workload side by side (``meshplan compare``): the comparison, its
verdict and table (:mod:`~meshplan.compare.verdict`), and what is written of it, the
``--json`` document, the HTML page and the rejected mesh's evidence
(:mod:`~meshplan.compare.output`).
"""

from meshplan.compare.output import compare_html, compare_to_dict, evidence_folder, write_evidence
from meshplan.compare.verdict import (
    Comparison,
    Row,
    Side,
    check_workload,
    compare,
    rows,
    rule_text,
    same_mesh,
    side_of,
    table_rows,
    table_values,
)

__all__ = ["Comparison", "Row", "Side", "check_workload", "compare", "compare_html", "compare_to_dict",
           "evidence_folder", "rows", "rule_text", "same_mesh", "side_of", "table_rows", "table_values",
           "write_evidence"]
