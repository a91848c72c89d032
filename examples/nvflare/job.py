"""An NVFlare job (FedJob) that fine-tunes a PEFT model and audits every client's upload with gradleak.

What an FL engineer adds to the NVFlare job they already run is the audit filter on the server, on both of the
server's chains (task data: it records the model sent; task result: it audits each client's result as it arrives)::

    audit = NVFlareAudit(CONFIG, out_dir, truth="config", block_at="strong")
    job.to_server(audit, filter_type=FilterType.TASK_DATA, tasks=["train"])
    job.to_server(audit, filter_type=FilterType.TASK_RESULT, tasks=["train"])

The federation itself is ordinary NVFlare: a server workflow (``GradleakController``, a ``ModelController`` that
sends the trainable params as an FLModel with ``send_model_and_wait`` and steps ``w -= lr * mean update``) and an
``Executor`` on every client that trains on its own private partition and replies FULL (new weights) or DIFF (the
weight change), in float64. The model comes from the gradleak config (``CONFIG``), so the server, the clients and
the audit build the same model from one description.

Run it (repo root)::

    python examples/nvflare/job.py examples/nvflare/text_adapters.yaml --out runs/nvflare_text
    python examples/nvflare/job.py examples/nvflare/vit_lora.yaml --out runs/nvflare_vit_lora --rounds 1

``--runtime simulator`` (default) runs the job in NVFlare's simulator (``FedJob.simulator_run``: the server in a child
process, each client ``site-1`` .. ``site-n`` in its own subprocess); ``--runtime inprocess`` runs the same
components in this process (seconds; NVFlare's messages, executor and filter chains, no simulator).
``--block-at partial|strong|exact`` blocks a result whose audit reaches that level (``ContentBlockedException``:
the server drops it before aggregation). ``--export DIR --runtime none`` only writes the job folder and a workspace
whose ``class_allow_list`` names gradleak's components (NVFlare 2.9 builds only listed classes); NVFlare's own CLI then
runs it: ``nvflare simulator DIR/gradleak -w DIR/workspace -n 3 -t 3``. The job names gradleak as an app package
(``set_app_packages``): every site imports the installed package, nothing is copied into the job.

``truth="config"`` is what a *simulation* knows: the clients' partitions are rebuilt from the config. A real
deployment leaves it out (``truth=""``); the audit then saves what the attacks reconstructed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_job(config: str, out: str, *, rounds: int | None = None, attacks: list[str] | None = None,
              block_at: str = "", reply: str | None = None, truth: str = "config"):
    """The FedJob: the controller on the server, the executor on every client, the audit filter on the server's
    task-data and task-result chains. Paths are made absolute (the simulator's processes run elsewhere)."""
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType

    from gradleak.integrations.nvflare import NVFlareAudit, controller_for, executor_for
    from gradleak.run.round_audit import validated_config

    config, out = str(Path(config).resolve()), str(Path(out).resolve())
    cfg = validated_config(config, "the NVFlare job")
    job = FedJob(name="gradleak")
    job.set_app_packages(["gradleak"])  # installed on every site: imported, not copied into the job's custom/ folder
    job.to_server(controller_for(config, rounds=rounds or cfg.fl.rounds))
    job.to_clients(executor_for(config, reply=reply or cfg.fl.nvflare.reply), tasks=["train"])
    audit = NVFlareAudit(config, out, attacks=list(attacks) if attacks else None, truth=truth, block_at=block_at or "")
    job.to_server(audit, filter_type=FilterType.TASK_DATA, tasks=["train"])
    job.to_server(audit, filter_type=FilterType.TASK_RESULT, tasks=["train"])
    return job, cfg, audit


def run(config: str, out: str, *, rounds: int | None = None, attacks: list[str] | None = None, block_at: str = "",
        runtime: str = "simulator", reply: str | None = None, workspace: str | None = None,
        export: str | None = None) -> dict:
    """Run the example; returns ``OUT/nvflare_audit.json`` as a dict (one entry per audited round) plus ``seconds``."""
    from gradleak.fl.engines.nvflare_bridge import COMPONENTS, allow_components, run_inprocess, run_simulator
    from gradleak.integrations.nvflare import AUDIT_COMPONENT

    allow = COMPONENTS + (AUDIT_COMPONENT,)  # gradleak's component classes, for the sites' class_allow_list
    if runtime == "none" and not export:
        raise SystemExit("--runtime none runs nothing: give --export DIR")
    job, cfg, audit = build_job(config, out, rounds=rounds, attacks=attacks, block_at=block_at, reply=reply)
    n = cfg.fl.clients
    if export:  # the job folder, and a workspace whose allow list names gradleak's components (for `nvflare simulator`)
        job.export_job(str(Path(export).resolve()))
        allow_components(Path(export).resolve() / "workspace", allow)
        if runtime == "none":
            return {"rounds": [], "seconds": 0.0, "exported": str(Path(export).resolve())}
    if runtime == "simulator":
        ws = Path(workspace or Path(out) / "nvflare_workspace").resolve()
        seconds = run_simulator(job, ws, n, allow=allow)
    else:  # the same components (controller's server rounds, the executor, the audit filter) in this process
        from gradleak.integrations.nvflare import executor_for, server_rounds_of_config

        cfg_path = str(Path(config).resolve())
        server, default_rounds = server_rounds_of_config(cfg_path)
        executor = executor_for(cfg_path, reply=reply or cfg.fl.nvflare.reply)
        seconds = run_inprocess(server, executor, n, rounds or default_rounds, task_data_filters=[audit],
                                task_result_filters=[audit])
    summary = Path(out) / "nvflare_audit.json"
    if not summary.exists():
        raise SystemExit(f"no audit was written to {summary} (see the NVFlare log above)")
    res = json.loads(summary.read_text())
    res["seconds"] = seconds
    return res


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", help="a gradleak config describing the federation (e.g. examples/nvflare/vit_lora.yaml)")
    p.add_argument("--out", default="runs/nvflare")
    p.add_argument("--rounds", type=int)
    p.add_argument("--runtime", choices=["simulator", "inprocess", "none"], default="simulator",
                   help="none: only --export the job (run it with `nvflare simulator`)")
    p.add_argument("--reply", choices=["FULL", "DIFF"], help="the clients' params type (default: fl.nvflare.reply)")
    p.add_argument("--attacks", nargs="*", help="restrict the audit to these attacks")
    p.add_argument("--block-at", choices=["partial", "strong", "exact"], default="",
                   help="block (ContentBlockedException) a result whose audit reaches this level")
    p.add_argument("--workspace", help="the simulator's workspace (default: OUT/nvflare_workspace)")
    p.add_argument("--export", help="also write the job folder (EXPORT/gradleak) and a workspace whose allow list names "
                                    "gradleak's components (EXPORT/workspace): `nvflare simulator EXPORT/gradleak -w "
                                    "EXPORT/workspace -n 3 -t 3`")
    a = p.parse_args(argv)
    res = run(a.config, a.out, rounds=a.rounds, attacks=a.attacks, block_at=a.block_at, runtime=a.runtime,
              reply=a.reply, workspace=a.workspace, export=a.export)
    if a.runtime == "none":
        print(f"job: {res['exported']}/gradleak; run it with: nvflare simulator {res['exported']}/gradleak "
              f"-w {res['exported']}/workspace -n <clients> -t <clients>")
        return 0
    for r in res["rounds"]:
        print(f"round {r['server_round']}: {r['headline']}"
              + (f"  blocked: {[b['site'] for b in r['blocked']]}" if r.get("blocked") else ""))
    print(f"{res['seconds']:.1f} s; per-round audits in {a.out}/round_<r>/audit.json and report.html")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
