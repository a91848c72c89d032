"""``gradleak`` command line (typer + rich). Thin: parses, calls :mod:`gradleak.run`, prints.

Exit codes (docs/DESIGN.md §4): 0 success, 2 bad input (a message naming the field and the fix), 1 internal error.
``gradleak audit --fail-on LEVEL`` adds 3: the CI gate tripped (:func:`fail_on_decision`).
``gradleak list``, ``--version`` and config validation import neither transformers nor any model: only the
registries (torch for the attack modules) — a bad ``--set`` is answered in about two seconds; ``gradleak list`` reads
the registries from a catalog cached per source digest (:func:`load_catalog`), so a warm call imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Measure private-data leakage in federated parameter-efficient fine-tuning.")
console = Console(stderr=True)
out_console = Console()
#: the width of a console that is not a terminal (a pipe, a file, CI) when COLUMNS does not say: tables and
#: messages are not cut at rich's 80-column default
PIPE_WIDTH = 200


def _fit_consoles() -> None:
    """Not a terminal: no 80-column wrap (COLUMNS if set, else :data:`PIPE_WIDTH`); a terminal keeps its width."""
    import os

    cols = os.environ.get("COLUMNS", "")
    for c in (console, out_console):
        if not c.is_terminal:
            c.width = int(cols) if cols.isdigit() and int(cols) > 0 else PIPE_WIDTH


def _log(msg: str) -> None:
    """A progress line on stderr: literal text (``[audit]`` is not rich markup), never wrapped."""
    console.print(msg, highlight=False, markup=False, soft_wrap=True)


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
    _fit_consoles()


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


@app.command()
def run(config: Path = typer.Argument(..., help="YAML config, e.g. configs/peftleak/cifar_b32.yaml"),
        out: Path = typer.Option(..., "--out", help="output directory for results.json and report.html"),
        set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config key: dotted.key=value"),
        device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N or auto (default: the config's)"),
        executor: str = typer.Option("local", "--executor", help="sweeps (a config with grid:): local process pool or ray"),
        workers: Optional[int] = typer.Option(None, "--workers", min=1, help="sweeps: parallel cells (default: CPU cores)"),
        yes: bool = typer.Option(False, "--yes", help="sweeps: run a grid larger than the cell limit"),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="also print every metric and timing (they are "
                                     "all in DIR/results.json)")):
    """Run one experiment and write DIR/results.json and DIR/report.html (a config with grid: runs a resumable
    sweep: DIR/results.jsonl, DIR/sweep.json). The console gives the answer -- what the attack recovered against
    chance, and its level -- and a short table; --verbose adds every metric."""
    from gradleak.errors import BadInput

    try:
        from gradleak.config.loading import load_yaml

        raw = load_yaml(config)  # the path is checked before anything heavy is imported
        if "grid" in raw:  # the runs check --out after validating the config (no folder for a refused config)
            from gradleak.run.sweep import run_sweep

            summary = run_sweep(raw, out, list(set_ or []), device, executor=executor, workers=workers, yes=yes,
                                log=_log)
            out_console.print(f"sweep: {summary['done']} of {summary['cells']} cells done"
                              + (f", {len(summary['failed'])} failed (rerun to retry)" if summary["failed"] else "")
                              + f" -> {out}/results.jsonl, {out}/sweep.json")
            if summary["failed"]:
                raise typer.Exit(code=1)
            return
        from gradleak.run import run_config

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
    _print_run(results, out, verbose)


#: the colour of the answer sentence by level (the audit's colours: leaking red, none green, undefined plain)
LEVEL_STYLE = {"exact": "bold red", "strong": "bold red", "partial": "bold yellow", "none": "bold green",
               "undefined": "bold"}


def fmt_metric(key: str, v) -> str:
    """A metric's value as the console prints it: a p-value at its null's floor as ``< 0.001``
    (:func:`gradleak.run.answer.fmt_p`), other numbers to four significant digits."""
    from gradleak.run.answer import fmt_p

    if key.endswith("_p_value") or "_p_value_" in key:
        return fmt_p(v, bare=True)
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def run_headline_rows(results: dict, answer: dict | None) -> list[tuple[str, str]]:
    """The short table under the answer: the level, the headline metric beside its chance level, null median and
    p-value, who was attacked and under which server, and the run's time (the full table: ``--verbose``)."""
    from gradleak.run.answer import METRIC_WORDS, fmt_p, num

    rows: list[tuple[str, str]] = []
    if answer is not None:
        unit = f" {answer['unit']}" if answer.get("unit") else ""
        words = METRIC_WORDS.get(answer["metric"], (answer["metric"], ""))[0]
        rows.append(("level", str(answer["level"])))
        rows.append((words + (f" ({answer['metric']})" if words != answer["metric"] else ""),
                     f"{num(answer['value'])}{unit}"))
        rows.append(("chance (the bar it is tested against)", f"{num(answer['chance'])}{unit}"))
        if answer.get("null_median") is not None:
            rows.append(("null median", f"{num(answer['null_median'])}{unit}"))
        rows.append(("p-value", fmt_p(answer.get("p_value"), bare=True)))
        if answer.get("clients", 1) > 1:
            rows.append(("clients attacked", f"{answer['clients']} (the most leaking: client {answer['client']})"))
        if answer.get("server"):
            rows.append(("server", answer["server"]))
    total = (results.get("timings") or {}).get("total_seconds")
    if isinstance(total, (int, float)):
        rows.append(("time", f"{total:.1f} s"))
    return rows


def _print_run(results: dict, out: Path, verbose: bool = False) -> None:
    """``gradleak run``'s console, answer first (:func:`gradleak.run.answer.run_answer`, the sentence the HTML
    report opens with), then :func:`run_headline_rows`; every metric and timing with ``--verbose``."""
    from gradleak.run.answer import run_answer

    answer = run_answer(results)
    if answer is not None:
        out_console.print(Text(answer["text"], style=LEVEL_STYLE.get(answer["level"], "bold")), soft_wrap=True)
    table = Table(title=f"{results['name']} -> {out}/results.json")
    table.add_column("metric" if verbose or answer is None else "measure")
    table.add_column("value", justify="right")
    if verbose or answer is None:  # no answer (an unregistered attack): the metrics are all there is to show
        for k, v in results["metrics"].items():
            table.add_row(k, fmt_metric(k, v))
        for k, v in results["timings"].items():
            table.add_row(f"time: {k}", f"{v:.4g}")
    else:
        for k, v in run_headline_rows(results, answer):
            table.add_row(k, v)
    out_console.print(table)
    for w in dict.fromkeys((results.get("details") or {}).get("warnings") or []):  # e.g. lora_span under-determined
        console.print(Text("warning: ", style="bold yellow") + Text(str(w)), soft_wrap=True, highlight=False)
    more = "" if verbose or answer is None else f" (all {len(results['metrics'])} metrics: --verbose, or results.json)"
    out_console.print(f"report: {out / 'report.html'}" + more, soft_wrap=True)


@app.command()
def audit(config: Path = typer.Argument(..., help="YAML config of the federated PEFT setup, e.g. configs/audit/vit_adapters.yaml"),
          out: Path = typer.Option(..., "--out", help="output directory for audit.json and report.html"),
          set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config key: dotted.key=value"),
          device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:N or auto (default: the config's)"),
          only: Optional[str] = typer.Option(None, "--only", help="comma list of attacks to try (default: every registered one)"),
          workers: Optional[int] = typer.Option(None, "--workers", min=1, help="attacks run in parallel, one torch thread "
                                                "each (default: the CPU cores; 1 = in this process)"),
          yes: bool = typer.Option(False, "--yes", help="a grid: larger than the cell limit"),
          advise: bool = typer.Option(False, "--advise", help="then search the weakest strength of each defense that "
                                      "stops every leaking attack, and its accuracy cost (resumable; also audit.advise)"),
          budget: Optional[float] = typer.Option(None, "--budget", help="--advise: seconds the search may take "
                                                 "(unfinished defenses are listed)"),
          executor: Optional[str] = typer.Option(None, "--executor", help="--advise: inline (one probe after "
                                                 "another), or local / ray: every candidate's next probe and the "
                                                 "utility runs in parallel (--workers of them). Default: local when "
                                                 "--workers > 1, else inline"),
          fail_on: Optional[str] = typer.Option(None, "--fail-on", help="CI gate: exit 3 when the worst level of the "
                                                "attacks the audit ran (over every client; under the configured "
                                                "threat or a stronger server's upgrade) reaches this level: partial, "
                                                "strong or exact; else 0. An undefined or crashed attack also exits 3 "
                                                "(the gate cannot be evaluated). Reads the audit's levels only (with "
                                                "--advise too: the advice does not change them). One audit, not a "
                                                "grid: config.")):
    """Run every applicable attack on one setup; write DIR/audit.json and DIR/report.html with a verdict."""
    from gradleak.errors import BadInput

    try:
        threshold = check_fail_on(fail_on)
        from gradleak.config.loading import load_yaml

        raw = load_yaml(config)
        from gradleak.run.audit import audit_command

        cmd = audit_command(config, out, list(set_ or []), only, device)  # every argument shell-quoted
        kw = dict(only=[x.strip() for x in only.split(",") if x.strip()] if only else None, command=cmd,
                  log=_log,
                  workers=workers if workers is not None else (__import__("os").cpu_count() or 1))
        if "grid" in raw:  # an audit per grid cell (e.g. per defense strength), resumable
            from gradleak.run.audit import run_audit_grid

            if advise or budget is not None:
                raise BadInput("--advise", "advises one setup, not an audit grid (the config has grid:).",
                               "drop grid: from the config, or drop --advise / --budget.")
            if threshold is not None:
                raise BadInput("--fail-on", "gates one audit, not an audit grid (the config has grid:).",
                               "drop grid: from the config (one audit per setup in CI), or drop --fail-on.")

            summary = run_audit_grid(raw, out, list(set_ or []), device, yes=yes, **kw)
            for row in summary["cells"]:
                out_console.print(f"{row['cell']}: {row['headline']}")
            out_console.print(f"-> {out}/audit_grid.json")
            return
        from gradleak.run.advise import run_audit_advised
        from gradleak.run.advise_options import check_budget

        check_budget(budget)
        if executor is not None and executor != "inline" and not advise:
            raise BadInput("--executor", "chooses how the --advise search runs its probes, but the audit is not "
                           "advising.", "add --advise, or drop --executor.")
        if executor is None:  # the probes of the candidates side by side on the cores --workers gives
            executor = "local" if kw["workers"] > 1 else "inline"
        result = run_audit_advised(raw, out, list(set_ or []), device, budget_seconds=budget, advise_on=advise,
                                   executor=executor, **kw)
    except BadInput as err:
        _fail_bad_input(err)
    _print_audit_table(result, out)
    colour = {"leaks": "red", "leaks_stronger_server": "yellow", "no_leak_found": "green"}.get(result["verdict"], "white")
    out_console.print(f"[bold {colour}]{escape(result['headline'])}[/]", soft_wrap=True)
    if result.get("advice") is not None:
        _print_advice(result["advice"])
    out_console.print(f"report: {out / 'report.html'}")
    if threshold is not None:
        code, line = fail_on_decision(result, threshold)
        out_console.print(Text(line, style="bold red" if code else "bold green"), soft_wrap=True)
        if code:
            raise typer.Exit(code=code)


#: the levels ``gradleak audit --fail-on`` accepts, weakest first (the leaking levels of gradleak.evaluation.levels)
FAIL_ON_LEVELS = ("partial", "strong", "exact")
#: the exit code of a tripped gate (0 passes; 2 stays bad input, 1 an internal error)
GATE_EXIT = 3


def check_fail_on(value: str | None) -> str | None:
    """``--fail-on``'s level (case and spaces ignored), None when not given; any other value is bad input."""
    from gradleak.errors import BadInput

    if value is None:
        return None
    level = value.strip().lower()
    if level not in FAIL_ON_LEVELS:
        raise BadInput("--fail-on", f"'{value}' is not a level the gate compares against.",
                       f"use --fail-on {', '.join(FAIL_ON_LEVELS[:-1])} or {FAIL_ON_LEVELS[-1]} "
                       "(none and undefined are not thresholds).")
    return level


def fail_on_decision(result: dict, threshold: str) -> tuple[int, str]:
    """``--fail-on``'s decision on an audit result: ``(exit code, the line saying why)``.

    The gate reads every attack the audit ran (``level`` present): under the configured threat *and* those run under
    a stronger server's upgrade (docs/DESIGN.md §6: never green while any attack is above its null); each entry's
    ``level`` is already its worst over clients, seeds and full-strength variants. Attacks refused as not applicable
    or left out by ``--only`` were not run and are not read. Rule, in order:

    1. the worst measured level (``none`` < ``partial`` < ``strong`` < ``exact``) reaches ``threshold``: exit 3;
    2. else an attack that ran is ``undefined`` (measured nothing) or ``failed`` (a run crashed, even if another
       variant measured): exit 3 -- the gate cannot be evaluated, a crash never passes it;
    3. else exit 0 (also when no attack ran at all).
    """
    from gradleak.evaluation.levels import LEVELS, level_rank

    ran = [e for e in result.get("attacks") or [] if "level" in e]
    measured = [e for e in ran if e.get("level") in LEVELS and e["level"] != "undefined"]
    worst = max(measured, key=lambda e: level_rank(e["level"]), default=None)
    found = worst["level"] if worst is not None else "none"
    incomplete = [e for e in ran if e.get("level") not in LEVELS or e["level"] == "undefined" or e.get("failed")]
    head = f"gate --fail-on {threshold}: "

    def by(e: dict) -> str:
        server = e.get("threat_words") or e.get("threat") or "?"
        return (f"by {e['name']} under {server}" if e.get("applicable")
                else f"by {e['name']}, under a stronger server than configured: {server}")

    if worst is not None and level_rank(found) >= level_rank(threshold):
        return GATE_EXIT, f"{head}FAIL -- worst level {found} ({by(worst)}) reaches {threshold}; exit {GATE_EXIT}"
    if incomplete:
        why = "; ".join(f"{e['name']}: {e.get('failed') or e.get('reason') or e.get('level')}" for e in incomplete)
        return GATE_EXIT, (f"{head}FAIL -- the gate could not be evaluated: {len(incomplete)} attack(s) undefined or "
                           f"failed ({why}); worst level measured {found}; exit {GATE_EXIT}")
    if worst is None:
        return 0, f"{head}pass -- no attack ran (nothing to gate); exit 0"
    return 0, f"{head}pass -- worst level {found} ({by(worst)}) is below {threshold}; exit 0"


def _print_audit_table(result: dict, out: Path) -> None:
    """The audit's table (:func:`gradleak.run.audit_report.console_table`, the framework round audits' too): attacks
    for another modality on one row, every note whole (wrapped at words, never cut)."""
    from gradleak.run.audit_report import console_table

    out_console.print(console_table(result, f"audit -> {out}/audit.json"))
    if result.get("dp_check"):
        from gradleak.run.audit_report import dp_check_words

        words = dp_check_words(result["dp_check"])
        out_console.print(Text("DP check: " + words[0], style="bold"), soft_wrap=True)
        for w in words[1:-1]:
            out_console.print(Text("  " + w), soft_wrap=True)


def _print_advice(advice: dict) -> None:
    """The advice table (cheapest first) and the recommendation."""
    from gradleak.run.audit_report import advice_rows

    rows = advice_rows(advice)
    if rows:
        table = Table(title="what stops each leak (weakest strength found, cheapest first)")
        for col in ("defense", "strength", "bracket", "levels there", "accuracy", "cost", "ε", "status"):
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*(Text(x) for x in row))
        out_console.print(table)
    out_console.print(Text(advice.get("sentence", ""), style="bold"), soft_wrap=True)
    for key in ("cost_note",):
        if advice.get(key):
            out_console.print(Text(f"note: {advice[key]}."), soft_wrap=True)
    if advice.get("unfinished"):
        out_console.print(Text(f"not finished within the budget: {', '.join(advice['unfinished'])}"), soft_wrap=True)


#: ``gradleak list WHAT``: the catalog sections each word selects
LIST_SECTIONS = {
    "experiments": ["experiments"],
    "models": ["models"],
    "peft": ["peft"],
    "attacks": ["attacks"],
    "defenses": ["update_defenses", "training_defenses"],
    "data": ["datasets"],
    "evaluators": ["evaluators"],
    "metrics": ["metrics"],
}


def source_digest() -> str:
    """sha256 of the package's ``.py`` files (relative path + bytes) and the interpreter's prefix: the key of
    ``gradleak list``'s cached catalog (:mod:`gradleak.run.catalog`), so an edited registry entry is never stale."""
    import hashlib

    from gradleak import code_digest

    return hashlib.sha256((sys.prefix + "\0" + code_digest()).encode()).hexdigest()[:20]


def _cached(kind: str, build):
    """``$GRADLEAK_CACHE/<kind>-<source digest>.json`` (default ``~/.cache/gradleak``), built and written atomically
    on a miss; a cache that cannot be written is skipped."""
    import os

    base = Path(os.environ.get("GRADLEAK_CACHE") or Path.home() / ".cache" / "gradleak").expanduser()
    path = base / f"{kind}-{source_digest()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = build()
    try:
        from gradleak.atomic import write_text_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(value))
    except OSError:
        pass
    return value


def load_catalog() -> dict:
    """The registries as data (:func:`gradleak.run.catalog.build_catalog`), cached per source digest: a cache hit
    imports no torch (about 0.3 s)."""
    def build():
        from gradleak.run.catalog import build_catalog

        return build_catalog()

    return _cached("catalog", build)


def model_lora_targets(name: str) -> dict:
    """A model's linear module names and default LoRA targets (:func:`gradleak.run.catalog.lora_targets`); a
    registered model's are cached like the catalog, a local directory's are read each time."""
    def build():
        from gradleak.run.catalog import lora_targets

        return lora_targets(name)

    if "/" in name or Path(name).expanduser().exists():
        return build()
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return _cached(f"lora-{safe}", build)


@app.command("list")
def list_(what: Optional[str] = typer.Argument(None, metavar="[attacks|defenses|data|models|experiments|peft|evaluators|metrics]",
                                               help="print only this registry"),
          modality: Optional[str] = typer.Option(None, "--modality", help="only entries for image or text data"),
          model: Optional[str] = typer.Option(None, "--model", help="print this model's LoRA target names (the linear "
                                              "modules peft.lora_targets may name), read without its weights")):
    """Print every experiment preset, model, PEFT kind, attack (parameters, threat requirements), defense,
    dataset, evaluator and metric; or one registry (``gradleak list attacks --modality text``), or a model's LoRA
    targets (``gradleak list --model minilm``)."""
    from gradleak.errors import BadInput

    if what is not None and what not in LIST_SECTIONS:
        import difflib

        near = difflib.get_close_matches(what, list(LIST_SECTIONS), n=1)
        _fail_bad_input(BadInput("WHAT", f"'{what}' is not a registry.", (f"did you mean '{near[0]}'? " if near else "")
                                 + f"use one of: {', '.join(LIST_SECTIONS)}."))
    if modality is not None and modality not in ("image", "text"):
        _fail_bad_input(BadInput("--modality", f"unknown modality '{modality}'.", "use image or text."))

    def head(title: str) -> None:
        out_console.print(Text(f"\n{title}", style="bold underline"))

    def line(text: str, indent: int = 2, style: str | None = None) -> None:
        out_console.print(Text(" " * indent + text, style=style or ""), soft_wrap=True)

    if model is not None:
        try:
            info = model_lora_targets(model)
        except BadInput as err:
            _fail_bad_input(err)
        head(f"{model}: LoRA targets (peft.lora_targets)")
        line("linear modules: " + ", ".join(info["linear"]))
        line("default: " + (", ".join(info["default"]) if info["default"]
                            else "none of this model's modules: set peft.lora_targets"))
        if what is None:
            return
    wanted = LIST_SECTIONS[what] if what else None
    for sec in load_catalog()["sections"]:
        if wanted is not None and sec["key"] not in wanted:
            continue
        entries = [e for e in sec["entries"] if modality is None or e["modality"] in (None, modality)]
        head(sec["title"])
        for e in entries:
            line(f"{e['name']} — {e['summary']}" + (f" [{e['tag']}]" if e["tag"] else ""),
                 style="bold" if e["bold"] else None)
            for d in e["details"]:
                line(d, 6)
        if sec["note"]:
            line(sec["note"])


@app.command("config-reference")
def config_reference():
    """Print every config key with its type, default and description, as Markdown, from the schema (docs/CONFIG.md is
    this output: ``gradleak config-reference > docs/CONFIG.md``)."""
    from gradleak.config.reference import config_reference as reference

    sys.stdout.write(reference())


@app.command()
def report(directory: Path = typer.Argument(..., help="a run directory (results.json), an audit directory (audit.json: "
                                             "gradleak audit's, or a Flower / NVFlare round's OUT/round_<r>), or "
                                             "either file itself")):
    """(Re)build DIR/report.html from DIR/results.json (a run) or DIR/audit.json (an audit: ``gradleak audit``'s or a
    framework round audit's, OUT/round_<r>/audit.json); the file itself may be named."""
    from gradleak.errors import BadInput

    if directory.is_file():  # results.json / audit.json named: the report goes beside it
        if directory.name not in ("results.json", "audit.json"):
            _fail_bad_input(BadInput("DIR", f"'{directory}' is neither a directory nor a results.json / audit.json.",
                                     "pass the directory gradleak wrote, or its results.json or audit.json."))
        if directory.name == "audit.json":
            _rebuild_audit_report(directory.parent, directory)
            return
        directory = directory.parent
    path, audit_path = directory / "results.json", directory / "audit.json"
    if not path.is_file() and audit_path.is_file():
        _rebuild_audit_report(directory, audit_path)
        return
    if not path.is_file():
        _fail_bad_input(BadInput("DIR", f"'{path}' does not exist (nor '{audit_path}').",
                                 "pass a directory written by `gradleak run` or `gradleak audit`."))
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
    from gradleak.run.answer import run_answer

    try:  # the answer sentence: rebuilt from results.json by today's rules
        extra = {**(extra if isinstance(extra, dict) else {}), "answer": run_answer(results)}
        write_report(results, directory, extra)
    except OSError as err:
        _fail_bad_input(_unwritable(directory, err))
    out_console.print(f"report: {directory / 'report.html'}")


def _unwritable(directory: Path, err: OSError):
    from gradleak.errors import BadInput

    return BadInput("DIR", f"cannot write '{directory / 'report.html'}': {err.strerror or err}.",
                    "copy the directory somewhere writable (e.g. cp -r DIR /tmp/) and run `gradleak report` on the copy.")


def _rebuild_audit_report(directory: Path, audit_path: Path) -> None:
    """``gradleak report`` on an audit directory: the audit's report.html rebuilt from audit.json alone."""
    from gradleak.errors import BadInput

    keys = ("verdict", "headline", "attacks", "levels", "setup", "threat", "command", "config_hash", "seed",
            "environment")
    result = None
    try:
        result = json.loads(audit_path.read_text(encoding="utf-8"))
        missing = [k for k in keys if not isinstance(result, dict) or k not in result]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
    except (ValueError, UnicodeDecodeError) as err:
        live = isinstance(result, dict) and "server_round" in result  # a Flower / NVFlare round's audit.json
        _fail_bad_input(BadInput("DIR", f"'{audit_path}' is not a gradleak audit file ({err})"
                                 + (": a framework round audit written before round audits carried the report's "
                                    "fields." if live else "."),
                                 "rerun the federation with the audit (FlowerAudit / NVFlareAudit) to write it again."
                                 if live else "rerun `gradleak audit CONFIG --out DIR` to write it again."))
    from gradleak.run.audit_report import write_audit_report

    try:
        path = write_audit_report(result, directory)
    except OSError as err:
        _fail_bad_input(_unwritable(directory, err))
    out_console.print(f"report: {path}")


#: load_images' config-field names -> this command's options (its BadInput messages name the option to change)
_GENERATOR_FIELDS = {"data.name": "--data", "data.n": "--n", "data.size": "--image-size", "data.image_size": "--image-size",
                     "model.num_channels": "--channels", "data.path": "--path", "image_size": "--image-size",
                     "images": "--data", "n": "--n", "epochs": "--epochs", "batch_size": "--batch-size",
                     "latent_dim": "--latent-dim", "data.split": "--split"}


@app.command("train-generator")
def train_generator(
        data: str = typer.Option("public-natural", "--data", help="a registered image dataset (gradleak list), "
                                 "e.g. public-natural, natural-crops, cifar-samples, fashion-mnist, image-folder"),
        n: int = typer.Option(2048, "--n", help="number of training images"),
        image_size: int = typer.Option(32, "--image-size", help="generator output size: 32 or 64"),
        channels: int = typer.Option(3, "--channels", help="1 (grey) or 3 (RGB)"),
        latent_dim: int = typer.Option(100, "--latent-dim", help="latent size nz"),
        epochs: int = typer.Option(25, "--epochs"),
        batch_size: int = typer.Option(64, "--batch-size"),
        seed: int = typer.Option(0, "--seed", help="seeds the data draw (generated sets), the init and the training"),
        path: Optional[str] = typer.Option(None, "--path", help="folder or .npz for --data image-folder|npz"),
        split: Optional[str] = typer.Option(None, "--split", help="the dataset's split where it has several, e.g. "
                                            "fashion-mnist test (the clients draw from train); default the loader's"),
        out: Path = typer.Option(..., "--out", help="output file, PATH.safetensors")):
    """Train a DCGAN generative prior (GIAS-style attacks) and write it as a safetensors file.

    The training images must be disjoint from the images the attack reconstructs (your responsibility).
    The file records --data, so an attack config can refuse a generator trained on the attacked set.
    """
    from gradleak.errors import BadInput

    try:
        if out.suffix != ".safetensors":
            raise BadInput("--out", f"'{out}' does not end in .safetensors.", "give a path like runs/gen.safetensors.")
        if out.exists() and out.is_dir():
            raise BadInput("--out", f"'{out}' is a directory.", "give a file path like runs/gen.safetensors.")
        if image_size not in (32, 64):
            raise BadInput("--image-size", f"a DCGAN generator makes 32×32 or 64×64 images, not {image_size}.",
                           "use --image-size 32 or 64.")
        if channels not in (1, 3):
            raise BadInput("--channels", f"expected 1 (grey) or 3 (RGB), got {channels}.", "use --channels 1 or 3.")
        for opt, v, lo in (("--n", n, 2), ("--latent-dim", latent_dim, 1), ("--epochs", epochs, 1),
                           ("--batch-size", batch_size, 2)):
            if v < lo:
                raise BadInput(opt, f"must be at least {lo}, got {v}.")
        try:
            import torch

            from gradleak.data import dataset_modality
            from gradleak.data.splits import load_images
            from gradleak.models.generator import save_generator, train_dcgan

            if dataset_modality(data) != "image":
                raise BadInput("--data", f"'{data}' is a text dataset; a generator needs images.",
                               "use an image dataset (gradleak list), e.g. public-natural.")
            images, _ = load_images(data, n, image_size, seed, "--n", path, resize=True, channels=channels, split=split)
            out.parent.mkdir(parents=True, exist_ok=True)
            prog = _progress()
            with prog:
                task = prog.add_task(f"DCGAN, {len(images)} {data} images", total=epochs)

                def progress(message: str) -> None:
                    prog.console.print(f"  {message}", highlight=False)
                    prog.update(task, advance=1)

                gen, info = train_dcgan(images.to(torch.float32), latent_dim=latent_dim, epochs=epochs,
                                        batch_size=batch_size, seed=seed, progress=progress)
            meta = {"data": data, "path": path, "n": len(images), "seed": seed, **info}
            if split is not None:
                meta["split"] = split
            save_generator(gen, out, info=meta)
        except BadInput as err:
            if err.field == "--n" and "images but" in err.problem:  # load_images speaks of the experiment config
                raise BadInput("--n", err.problem.split(" (")[0] + ".",
                               "lower --n or use public-natural / natural-crops (any number of images).") from None
            if err.field in _GENERATOR_FIELDS:
                raise BadInput(_GENERATOR_FIELDS[err.field], err.problem, err.fix) from None
            raise
    except BadInput as err:
        _fail_bad_input(err)
    out_console.print(f"generator: {out} ({image_size}×{image_size}×{channels}, latent {latent_dim}; "
                      f"last epoch loss D {info['last_epoch_loss_d']:.3f}, loss G {info['last_epoch_loss_g']:.3f}, "
                      f"{info['seconds']:.0f} s)")


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
