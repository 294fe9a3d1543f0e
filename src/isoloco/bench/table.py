"""A benchmark's result as a markdown table, with the notes that say how to read it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Table:
    """Rows of already formatted cells under `columns`, a title and free-text notes."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: a row of {len(cells)} cells under {len(self.columns)} columns")
        self.rows.append([str(cell) for cell in cells])

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines += [""] + self.notes
        return "\n".join(lines)


def ratio(value: float) -> str:
    """A ratio with three significant figures (× suffix)."""
    return f"{value:.3g}×" if math.isfinite(value) else str(value)


def percent(value: float) -> str:
    """A fraction shown as a percentage with three significant figures."""
    return f"{100 * value:.3g}%"


def megabytes(count: float) -> str:
    return f"{count / 2**20:,.1f} MiB"


def kibibytes(count: float) -> str:
    return f"{count / 2**10:,.1f} KiB"
