"""``gradleak`` command line (typer + rich). Thin: parses, calls :mod:`gradleak.experiments`, prints.

Exit codes (DESIGN §4): 0 success, 2 bad input (a message naming the field and the fix), 1 internal error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Measure private-data leakage in federated parameter-efficient fine-tuning.")
console = Console(stderr=True)
out_console = Console()


def _fail_bad_input(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}", soft_wrap=True, markup=True)
    raise typer.Exit(code=2)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)
    return prog


@app.command()
def run(config: Path = typer.Argument(..., help="YAML config, e.g. configs/peftleak/cifar_b32.yaml"),
        out: Path = typer.Option(..., "--out", help="output directory for results.json and report.html"),
        set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config key: dotted.key=value"),
        device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N or auto (default: the config's)")):
    """Run one experiment and write DIR/results.json and DIR/report.html."""
    from gradleak.errors import BadInput
    from gradleak.experiments import run_file

    prog = _progress()

    def track(iterable, description: str = "", total: int | None = None):
        yield from prog.track(iterable, description=description, total=total)

    try:
        with prog:
            results = run_file(config, out, list(set_ or []), device, track)
    except BadInput as err:
        _fail_bad_input(err)
    table = Table(title=f"{results['name']} -> {out}/results.json")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in results["metrics"].items():
        table.add_row(k, f"{v:.4g}" if isinstance(v, (int, float)) else str(v))
    for k, v in results["timings"].items():
        table.add_row(f"time: {k}", f"{v:.4g}")
    out_console.print(table)
    out_console.print(f"report: {out / 'report.html'}")


@app.command("list")
def list_():
    """Print every registered experiment, attack, defense, dataset and metric with a one-line summary."""
    from gradleak.registry import ATTACKS, DATASETS, DEFENSES, EXPERIMENTS, METRICS, load_all

    load_all()
    for reg in (EXPERIMENTS, ATTACKS, DEFENSES, DATASETS, METRICS):
        table = Table(title=f"{reg.kind}s")
        table.add_column("name")
        table.add_column("summary")
        for e in reg:
            table.add_row(e.name, e.summary)
        out_console.print(table)


@app.command()
def report(directory: Path = typer.Argument(..., help="a run directory holding results.json")):
    """(Re)build DIR/report.html from DIR/results.json."""
    from gradleak.errors import BadInput
    from gradleak.report import write_report

    path = directory / "results.json"
    if not path.exists():
        _fail_bad_input(BadInput("DIR", f"'{path}' does not exist.", "pass a directory written by `gradleak run`."))
    results = json.loads(path.read_text())
    extra_path = directory / "report_data.json"
    extra = json.loads(extra_path.read_text()) if extra_path.exists() else {}
    write_report(results, directory, extra)
    out_console.print(f"report: {directory / 'report.html'}")


def main() -> None:  # pragma: no cover - entry point
    try:
        app()
    except SystemExit:
        raise
    except Exception as err:  # internal error: exit 1 with the traceback for a bug report
        console.print_exception()
        console.print(f"[bold red]internal error:[/] {err}")
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
