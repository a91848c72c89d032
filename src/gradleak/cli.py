"""``gradleak`` command line (typer + rich). Thin: parses, calls :mod:`gradleak.experiments`, prints.

Exit codes (DESIGN §4): 0 success, 2 bad input (a message naming the field and the fix), 1 internal error.
``gradleak list``, ``--version`` and config validation import neither transformers nor any model: only the
registries (torch for the attack modules) — a bad ``--set`` is answered in about two seconds.
"""

from __future__ import annotations

import contextlib
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
    from rich.text import Text

    console.print(Text("error: ", style="bold red") + Text(str(err)), soft_wrap=True, highlight=False)
    raise typer.Exit(code=2)


def _version(value: bool) -> None:
    if value:
        from gradleak import __version__

        out_console.print(f"gradleak {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")):
    """Measure private-data leakage in federated parameter-efficient fine-tuning."""


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


@app.command()
def run(config: Path = typer.Argument(..., help="YAML config, e.g. configs/peftleak/cifar_b32.yaml"),
        out: Path = typer.Option(..., "--out", help="output directory for results.json and report.html"),
        set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config key: dotted.key=value"),
        device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N or auto (default: the config's)")):
    """Run one experiment and write DIR/results.json and DIR/report.html."""
    from gradleak.errors import BadInput

    try:
        from gradleak.experiments.config import load_yaml

        raw = load_yaml(config)  # the path is checked before anything heavy is imported
        from gradleak.experiments.runner import check_out_dir

        check_out_dir(out)
        from gradleak.experiments import run_config

        prog = _progress()

        def track(iterable, description: str = "", total: int | None = None):
            yield from prog.track(iterable, description=description, total=total)

        @contextlib.contextmanager
        def stage(description: str):
            task = prog.add_task(description, total=None)
            try:
                yield
            finally:
                prog.update(task, total=1, completed=1)

        with prog:
            results = run_config(raw, out, list(set_ or []), device, track, stage)
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


def _params(cls) -> str:
    fields = getattr(cls, "model_fields", {})
    parts = []
    for name, f in fields.items():
        default = f.default if f.default is not None else "null"
        parts.append(f"{name}={default}")
    return ", ".join(parts)


def _init_params(cls) -> str:
    import inspect

    sig = inspect.signature(cls.__init__)
    return ", ".join(f"{n}" + ("" if p.default is inspect._empty else f"={p.default}")
                     for n, p in sig.parameters.items() if n not in ("self", "seed"))


@app.command("list")
def list_():
    """Print every experiment preset, model, PEFT kind, attack (parameters, threat requirements), defense,
    dataset, evaluator and metric."""
    from gradleak.registry import ATTACKS, DATASETS, DEFENSES, EXPERIMENTS, METRICS, load_all

    load_all()
    from gradleak.experiments.evaluation import EVALUATORS
    from gradleak.models import MODELS
    from gradleak.peft import KIND_FIELDS, PEFT_KINDS

    def simple(reg, extra=None):
        table = Table(title=f"{reg.kind}s")
        table.add_column("name")
        table.add_column("summary")
        if extra:
            table.add_column(extra[0])
        for e in reg:
            row = [e.name, e.summary]
            if extra:
                row.append(extra[1](e))
            table.add_row(*row)
        out_console.print(table)

    simple(EXPERIMENTS)
    simple(MODELS, ("data", lambda e: getattr(e.obj, "modality", "")))
    out_console.print("  (text experiments also take a local HF model directory as model.name)")
    simple(PEFT_KINDS, ("peft.* parameters", lambda e: ", ".join(sorted(KIND_FIELDS[e.name]))))
    table = Table(title="attacks")
    for col in ("name", "summary", "applies to", "threat requirements", "parameters (attack.*)"):
        table.add_column(col)
    for e in ATTACKS:
        c = e.obj
        req = [k for k, v in c.requires().items() if v] or ["none"]
        table.add_row(e.name, e.summary, f"{c.modality}; peft {'/'.join(c.peft_kinds)}; -> {c.reconstruction}",
                      ", ".join(req), _params(c.Config))
    out_console.print(table)
    simple(DEFENSES, ("parameters (defenses[i].params)", lambda e: _init_params(e.obj)))
    simple(DATASETS)
    simple(EVALUATORS)
    simple(METRICS)


@app.command()
def report(directory: Path = typer.Argument(..., help="a run directory holding results.json")):
    """(Re)build DIR/report.html from DIR/results.json."""
    from gradleak.errors import BadInput

    path = directory / "results.json"
    if not path.is_file():
        _fail_bad_input(BadInput("DIR", f"'{path}' does not exist.", "pass a directory written by `gradleak run`."))
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(results, dict) or "metrics" not in results:
            raise ValueError("no 'metrics' object at the top level")
    except (ValueError, UnicodeDecodeError) as err:
        _fail_bad_input(BadInput("DIR", f"'{path}' is not a gradleak results file ({err}).",
                                 "rerun `gradleak run CONFIG --out DIR` to write it again."))
    from gradleak.report import write_report

    extra_path = directory / "report_data.json"
    extra = {}
    if extra_path.exists():
        try:
            extra = json.loads(extra_path.read_text(encoding="utf-8"))
        except ValueError:
            extra = {}
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
