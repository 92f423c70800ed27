"""A metrics backend writing long-format CSV (``step,name,value``), one row per value.

Long format keeps the file valid when different steps log different metrics. The file is
appended to and flushed after every step, so a resumed run continues it.
"""

from __future__ import annotations

import csv
from pathlib import Path


class CsvBackend:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None
        self._writer = None

    def start(self, config, manifest) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        is_new = not self.path.exists()
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        if is_new:
            self._writer.writerow(["step", "name", "value"])

    def log(self, step, metrics) -> None:
        self._writer.writerows([step, name, repr(float(value))] for name, value in metrics.items())
        self._file.flush()

    def finish(self, summary) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_csv_metrics(path: Path) -> list[tuple[int, dict[str, float]]]:
    """The (step, metrics) records of a file written by :class:`CsvBackend`, in order."""
    records: dict[int, dict[str, float]] = {}
    with Path(path).open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            records.setdefault(int(row["step"]), {})[row["name"]] = float(row["value"])
    return list(records.items())


def build_csv(options, context) -> CsvBackend:
    return CsvBackend(Path(context.run_dir) / options.filename)
