"""Reports (docs/DESIGN.md §2): image grids, the self-contained HTML report and Markdown tables."""

from __future__ import annotations

from gradleak.report.html import rebuild_report, render_html, write_report
from gradleak.report.images import grid_array, save_image_grid
from gradleak.report.markdown import fmt, markdown_table, update_section

__all__ = ["write_report", "rebuild_report", "render_html", "save_image_grid", "grid_array", "markdown_table",
           "update_section", "fmt"]
