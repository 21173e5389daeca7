"""Two meshes of one workload side by side (``meshplan compare``): the comparison, its
verdict (:mod:`~meshplan.compare.verdict`), each side's numbers (:mod:`~meshplan.compare.sides`),
the reasons under the verdict (:mod:`~meshplan.compare.reasons`), the side-by-side table
(:mod:`~meshplan.compare.table`), and what is written of it, the
``--json`` document, the HTML page and the rejected mesh's evidence
(:mod:`~meshplan.compare.output`); what the two configs differ in besides the mesh
(:mod:`~meshplan.compare.differences`).
"""

from meshplan.compare.output import compare_html, compare_to_dict, evidence_folder, write_evidence
from meshplan.compare.sides import Side, check_workload, same_mesh, side_of
from meshplan.compare.table import Row, gemm_basis, rows, table_rows, table_values
from meshplan.compare.verdict import Comparison, compare, rule_text

__all__ = ["Comparison", "Row", "Side", "check_workload", "compare", "compare_html", "compare_to_dict",
           "evidence_folder", "gemm_basis", "rows", "rule_text", "same_mesh", "side_of", "table_rows", "table_values",
           "write_evidence"]
