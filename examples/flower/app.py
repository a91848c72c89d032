"""A Flower app (Message API) that fine-tunes a PEFT model and audits every round with gradleak.

What an FL engineer adds to the Flower app they already run is three lines on the server::

    strategy = GradleakStrategy(FedAvg(...), lr=lr, algorithm="fedsgd",
                                on_round=FlowerAudit(CONFIG, out_dir, truth=...), audit_every=k)

and, optionally, gradleak's defenses (``defense_mod``) and a client-side leakage score (``scoring_mod``) as client
mods. The federation itself is ordinary Flower: a ``ServerApp`` running ``strategy.start(...)`` and a
``ClientApp`` whose ``train`` function loads the arrays it was sent, takes SGD steps with torch on its own private
data and replies with its new weights and ``num-examples``. The model comes from the gradleak config (``CONFIG``),
so the server, the clients and the audit build the same model from one description.

Run it (repo root; in-process, no Ray)::

    python examples/flower/app.py examples/flower/vit_lora.yaml --out runs/flower_vit_lora
    python examples/flower/app.py examples/flower/text_adapters.yaml --out runs/flower_text --rounds 2

``--runtime simulation`` runs the same apps through Flower's simulation engine (Ray, ``gradleak[fl-simulation]``);
``flwr run examples/flower`` runs them with Flower's own launcher (``pyproject.toml`` here names the components and
the run config). ``--defense '{"name": "gaussian_noise", "params": {"std": 0.01}}'`` defends every client;
``--client-score`` lets every client score its own leakage and send only the scalars; ``--advise`` searches, on the
first audited round, the weakest defense that stops every leaking attack (Flower's ``LocalDpMod`` and central-DP
wrappers among the candidates; ``OUT/round_<r>/advice.html``), ``--budget S`` bounds that search.

The ground truth handed to ``FlowerAudit`` (``truth=``) is what a *simulation* knows: the clients' partitions are
rebuilt from the config. A real deployment leaves it out; the audit then saves what the attacks reconstructed (each
attack's level ``undefined``: nothing on the server scores it) and reports the clients' own scores.

Each audited round writes ``OUT/round_<r>/audit.json`` and ``OUT/round_<r>/report.html`` (``gradleak audit``'s page;
``gradleak report OUT/round_<r>/audit.json`` rebuilds it) and prints the round as ``gradleak audit`` words it: the
verdict's sentence with its null first, then the audit's short table.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from gradleak.integrations.flower import (FlowerAudit, GradleakStrategy, build_model, client_scorer, defense_mod,
                                          run_inprocess, run_simulation_engine, scoring_mod, to_arrays, to_tensors)

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------ shared by both apps

@lru_cache(maxsize=4)
def model_of(config: str):
    """(handle, cfg) for a config path, built once per process (the server and each client process)."""
    return build_model(config)


@lru_cache(maxsize=4)
def partitions(config: str):
    """Every client's private batch, in the pipeline's form (images in [0, 1] / texts) -- each client loads its own;
    the server uses them only as the simulation's ground truth."""
    from gradleak.data.splits import ImageData, TextData

    handle, cfg = model_of(config)
    data = ImageData(cfg) if cfg.modality == "image" else TextData(cfg)
    return tuple(data.clients(0, cfg.model.num_classes))


def run_cfg(context: Context) -> dict:
    """The run config: Flower's (``flwr run``, the in-process runner), or the one ``run`` exported for the
    simulation engine (whose Python entry point takes none)."""
    import os

    rc = dict(context.run_config or {})
    if "gradleak-config" not in rc and os.environ.get("GRADLEAK_FLOWER_RUN_CONFIG"):
        rc = json.loads(os.environ["GRADLEAK_FLOWER_RUN_CONFIG"])
    if "gradleak-config" not in rc:
        raise SystemExit("the run config has no 'gradleak-config' (the path of the gradleak config of the federation)")
    return rc


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def model_inputs(handle, cfg, x):
    """What the model eats: images scaled to [-1, 1], or token ids stacked with the attention mask."""
    if handle.modality == "image":
        return x.to(next(handle.model.parameters()).dtype) * 2 - 1
    enc = handle.text_model.encode(list(x), cfg.data.max_length)
    return torch.stack([enc["input_ids"], enc["attention_mask"]], 1)


# ------------------------------------------------------------------------------------------ ClientApp

client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    rc = run_cfg(context)
    config = str(rc["gradleak-config"])
    handle, cfg = model_of(config)
    pid = int(context.node_config["partition-id"])
    x, y = partitions(config)[pid]
    model = handle.model
    sent = to_tensors(msg.content["arrays"])
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, v in sent.items():
            params[k].copy_(v.to(params[k].dtype))
    lr = float(msg.content["config"]["lr"])
    steps = int(rc.get("local-steps", 1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    inputs = model_inputs(handle, cfg, x)
    loss_fn = handle.loss_fn or (lambda m, a, b: torch.nn.functional.cross_entropy(
        (lambda o: o.logits if hasattr(o, "logits") else o)(m(a)), b))
    reply = cfg.fl.flower.reply  # "weights": Flower's convention; "update": the (pseudo-)gradient itself
    moved = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model, inputs, y).backward()
        for n, p in model.named_parameters():
            if p.requires_grad and p.grad is not None:
                moved[n] += lr * p.grad.detach().to(torch.float64)
        opt.step()
    arrays = trainable(model) if reply == "weights" else {n: v / lr for n, v in moved.items()}
    return Message(RecordDict({"arrays": to_arrays(arrays),
                               "metrics": MetricRecord({"num-examples": len(y), "partition-id": pid,
                                                        "local-steps": steps})}), reply_to=msg)


# ------------------------------------------------------------------------------------------ ServerApp

server_app = ServerApp()
STRATEGIES: list = []  # the run's strategy, for callers in this process (tests read its record)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    rc = run_cfg(context)
    config = str(rc["gradleak-config"])
    handle, cfg = model_of(config)
    nodes = len(list(grid.get_node_ids()))
    audit = FlowerAudit(config, rc.get("out", "runs/flower"), truth=lambda _r: list(partitions(config)),
                        attacks=json.loads(str(rc["attacks"])) if rc.get("attacks") else None,
                        advise=json.loads(str(rc["advise"])) if rc.get("advise") else False,
                        budget=float(rc["budget"]) if rc.get("budget") else None)
    strategy = GradleakStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=nodes,
                                       min_train_nodes=nodes),
                                lr=cfg.fl.lr, algorithm=cfg.fl.algorithm, on_round=audit, reply=cfg.fl.flower.reply,
                                audit_every=int(rc.get("audit-every", 1)))
    STRATEGIES.append(strategy)
    strategy.start(grid=grid, initial_arrays=to_arrays(trainable(handle.model)),
                   num_rounds=int(rc.get("num-server-rounds", cfg.fl.rounds)),
                   train_config=ConfigRecord({"lr": cfg.fl.lr}))


def with_mods(defenses: list[dict], client_score: bool, config: str, attacks: list[str] | None = None) -> ClientApp:
    """The ClientApp with gradleak's client mods: the client's own leakage score outermost (it sees the update as
    it leaves), then the defenses."""
    mods = []
    if client_score:
        handle, cfg = model_of(config)

        def own_batch(ctx):
            return partitions(config)[int(ctx.node_config["partition-id"])]

        mods.append(scoring_mod(client_scorer(config, own_batch, attacks=attacks), lr=cfg.fl.lr,
                                algorithm=cfg.fl.algorithm))
    if defenses:
        _, cfg = model_of(config)
        mods.append(defense_mod(defenses, algorithm=cfg.fl.algorithm, lr=cfg.fl.lr))
    if not mods:
        return client_app
    app = ClientApp(mods=mods)
    app.train()(train)
    return app


def run(config: str, out: str, *, rounds: int | None = None, nodes: int | None = None, runtime: str = "inprocess",
        defenses: list[dict] | None = None, client_score: bool = False, audit_every: int = 1,
        attacks: list[str] | None = None, advise: bool | dict = False, budget: float | None = None) -> dict:
    """Run the example; returns ``OUT/flower_audit.json`` as a dict (one entry per audited round)."""
    _, cfg = model_of(config)
    run_config = {"gradleak-config": config, "out": out, "num-server-rounds": rounds or cfg.fl.rounds,
                  "audit-every": audit_every, "attacks": json.dumps(attacks) if attacks else "",
                  "advise": json.dumps(advise) if advise else "", "budget": float(budget) if budget else 0.0}
    capp = with_mods(defenses or [], client_score, config, attacks)
    n = nodes or cfg.fl.clients
    if runtime == "simulation":
        import os

        saved = {k: os.environ.get(k) for k in ("GRADLEAK_FLOWER_RUN_CONFIG", "PYTHONPATH")}
        os.environ["GRADLEAK_FLOWER_RUN_CONFIG"] = json.dumps(run_config)
        # Ray's workers import this module by name (``app``), so they need its folder on their path
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        try:
            seconds = run_simulation_engine(server_app, capp, n)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    else:
        seconds = run_inprocess(server_app, capp, n, run_config)
    res = json.loads((Path(out) / "flower_audit.json").read_text())
    res["seconds"] = seconds
    return res


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", help="a gradleak config describing the federation (e.g. examples/flower/vit_lora.yaml)")
    p.add_argument("--out", default="runs/flower")
    p.add_argument("--rounds", type=int)
    p.add_argument("--nodes", type=int, help="client nodes (default: the config's fl.clients)")
    p.add_argument("--runtime", choices=["inprocess", "simulation"], default="inprocess")
    p.add_argument("--audit-every", type=int, default=1)
    p.add_argument("--defense", action="append", default=[], help="a defenses: entry as JSON (repeatable)")
    p.add_argument("--client-score", action="store_true", help="every client scores its own leakage (scalars only)")
    p.add_argument("--attacks", nargs="*", help="restrict the audit to these attacks")
    p.add_argument("--advise", nargs="?", const="true", default=None, metavar="JSON",
                   help="search the weakest defense that stops every leaking attack (Flower's DP among the candidates); "
                        "optionally a mapping, e.g. '{\"candidates\": [\"LocalDpMod\"], \"steps\": 2}'")
    p.add_argument("--budget", type=float, help="seconds bounding the --advise search")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the config (as gradleak run --set); the resolved config is OUT/config.yaml")
    a = p.parse_args(argv)
    if a.set:  # one resolved file, so the server, the clients and the audit read the same config
        import yaml

        from gradleak.config.loading import apply_overrides, load_yaml
        from gradleak.config.schema import ExperimentConfig

        resolved = Path(a.out) / "config.yaml"
        resolved.parent.mkdir(parents=True, exist_ok=True)
        resolved.write_text(yaml.safe_dump(apply_overrides(load_yaml(a.config), a.set, ExperimentConfig), sort_keys=False))
        a.config = str(resolved)
    res = run(a.config, a.out, rounds=a.rounds, nodes=a.nodes, runtime=a.runtime, audit_every=a.audit_every,
              defenses=[json.loads(d) for d in a.defense], client_score=a.client_score, attacks=a.attacks,
              advise=json.loads(a.advise) if a.advise else False, budget=a.budget)
    for r in res["rounds"]:
        print(f"round {r['server_round']}: {r['headline']}" + (f"  client scores: {r['client_scores']}"
                                                             if r["client_scores"] else ""))
        if r.get("advice"):
            print(f"  advice: {r['advice']['sentence']} (round_{r['server_round']}/advice.html)")
    print(f"{res['seconds']:.1f} s; per-round audits in {a.out}/round_<r>/audit.json and report.html")
    return 0


if __name__ == "__main__":
    # run as the module ``app`` (not ``__main__``): Ray pickles the apps' functions by module name
    sys.path.insert(0, str(HERE))
    import app as _app

    sys.exit(_app.cli())
