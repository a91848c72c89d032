"""gradleak on an NVFlare federation: audit what an NVFlare server receives, client by client, on the server's
task-result filter chain (docs/DESIGN.md §7).

Optional extra ``nvflare`` (``pip install 'gradleak[nvflare]'``, ``nvflare==2.9.0``); ``nvflare`` is imported inside
functions only (:class:`NVFlareAudit` is built on first access). The pieces:

* :class:`NVFlareAudit` -- an NVFlare ``DXOFilter`` for the server. On the **task-result** chain
  (``task_result_filters`` / ``FedJob.to_server(audit, filter_type=FilterType.TASK_RESULT)``) it records each
  client's result as it arrives (a DXO of FLModel params: WEIGHTS = FULL new weights, WEIGHT_DIFF = DIFF, with the
  round's header) and audits *that client on its own upload* at once with
  :class:`gradleak.run.round_audit.RoundAudit` (a :class:`~gradleak.fl.recorded.RecordedRound` holding the one
  update), so every client of a round is attacked, and ``block_at`` can stop a leaking upload before the workflow
  aggregates it: a result whose audit reaches ``partial`` | ``strong`` | ``exact`` raises NVFlare's
  ``ContentBlockedException`` (the server runner then drops it: ``TASK_RESULT_FILTER_ERROR``). After each result
  ``OUT/round_<r>/audit.json`` holds the round so far (the one entry shape: each attack's ``per_client`` rows, the
  worst client's judgement, the verdict, ``gradleak audit``'s report fields), ``OUT/round_<r>/report.html`` is
  ``gradleak audit``'s page of it (:func:`gradleak.run.round_audit.write_round`), and ``OUT/nvflare_audit.json`` every
  audited round. The console gives the client's level, then the round so far answer first
  (:func:`gradleak.run.round_audit.round_console`: the verdict's sentence with its null, the audit's short table).
  On the **task-data** chain (``FilterType.TASK_DATA``) the same filter records the model the server sends each
  round, which the audit needs (the attack reads the sent weights; a FULL reply's update is ``(sent − new) / lr``):
  add it to both chains.
  Rounds are numbered from 1 in the files (NVFlare's ``current_round`` + 1, as the Flower audit numbers them).
* :func:`executor_for` / :func:`controller_for` -- the job's client and server components
  (:class:`~gradleak.fl.engines.nvflare_bridge.GradleakExecutor`, ``GradleakController``) built from a gradleak
  config, so the server, every client and the audit build one model from one description; the builders they name
  (:func:`client_side_of_config`, :func:`server_rounds_of_config`) run in the simulator's processes.
* :func:`partitions` -- every client's private batch as the pipeline draws it (a simulation's ground truth).
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch

from gradleak.errors import BadInput
from gradleak.fl.engines.nvflare_bridge import (META_CLIENT, META_LR, META_SAMPLES, META_STEPS, ClientSide,
                                                ServerRounds, require_nvflare, site_index, to_torch, update_of)
from gradleak.fl.recorded import ClientReply, RecordedRound

__all__ = ["AUDIT_COMPONENT", "BLOCK_LEVELS", "client_side_of_config", "controller_for", "executor_for", "partitions",
           "server_rounds_of_config"]

#: the levels ``block_at`` accepts (gradleak's graded leakage, docs/DESIGN.md §6)
BLOCK_LEVELS = ("partial", "strong", "exact")
CLIENT_BUILDER = "gradleak.integrations.nvflare:client_side_of_config"
SERVER_BUILDER = "gradleak.integrations.nvflare:server_rounds_of_config"
#: the filter's class path (for a site's ``class_allow_list``: :func:`gradleak.fl.engines.nvflare_bridge.allow_components`)
AUDIT_COMPONENT = f"{__name__}.NVFlareAudit"

#: what the server sent each round, per audit output folder (the task-data and task-result filters of one job are
#: two instances in the server process: they meet here)
_SENT: dict[str, dict[int, dict[str, torch.Tensor]]] = {}


# ------------------------------------------------------------------------------------------ the federation of a config

@lru_cache(maxsize=4)
def _federation(config: str):
    """``(handle, cfg, data)`` of a gradleak config path, built once per process (the server and each client)."""
    from gradleak.modalities import modality_data
    from gradleak.run.pipeline import build_handle
    from gradleak.run.round_audit import validated_config

    cfg = validated_config(config, "the NVFlare job")
    handle, _ = build_handle(cfg)
    data = modality_data(cfg)
    cfg.training_defense.apply(handle, cfg, data=data)  # a training-time defense re-parameterises first (FISGuard)
    return handle, cfg, data


@lru_cache(maxsize=4)
def partitions(config: str) -> tuple:
    """Every client's private batch of the config's data, in the pipeline's form (images in [0, 1] / texts): each
    client trains on its own; the audit uses them only as a simulation's ground truth."""
    handle, cfg, data = _federation(str(config))
    return tuple(data.clients(0, cfg.model.num_classes))


def client_side_of_config(config: str, *, reply: str = "FULL") -> ClientSide:
    """The clients of the federation a gradleak config describes (the executor's builder): the model + PEFT as the
    pipeline builds it, each client's :class:`~gradleak.fl.core.Client` on its partition, the update defenses and the
    training-time defense's step, the public protocol (algorithm, local epochs and batch size, seed)."""
    from gradleak.run.pipeline import clients_and_truth, round_defenses_and_loss

    handle, cfg, _ = _federation(str(config))
    defenses, loss_fn = round_defenses_and_loss(cfg, handle, handle.model)
    clients, _ = clients_and_truth(handle, list(partitions(str(config))), loss_fn, torch.device("cpu"),
                                   cfg.threat_model, cfg)
    return ClientSide(handle.model, clients, algorithm=cfg.fl.algorithm, local_epochs=cfg.fl.local_epochs,
                      local_batch_size=cfg.fl.local_batch_size,
                      defenses=[d for d in defenses if not getattr(d, "server_side", False)], seed=cfg.seed,
                      local_update=cfg.training_defense.local_update,
                      client_settings=cfg.client_plan() if cfg.fl.algorithm == "fedavg" else None, reply=reply)


def server_rounds_of_config(config: str) -> tuple[ServerRounds, int]:
    """The honest server of the federation a gradleak config describes (the controller's builder) and its rounds."""
    from gradleak.run.pipeline import round_defenses_and_loss

    handle, cfg, _ = _federation(str(config))
    defenses, _ = round_defenses_and_loss(cfg, handle, handle.model)
    server = ServerRounds(handle.model, algorithm=cfg.fl.algorithm, lr_of=cfg.fl.lr_at, seed=cfg.seed,
                          central=[d for d in defenses if getattr(d, "server_side", False)])
    return server, int(cfg.fl.rounds)


def executor_for(config: str, *, reply: str = "FULL"):
    """The client component of an NVFlare job for a gradleak config (``FedJob.to_clients(executor_for(cfg))``)."""
    from gradleak.fl.engines.nvflare_bridge import GradleakExecutor

    return GradleakExecutor(config=str(config), builder=CLIENT_BUILDER, reply=reply)


def controller_for(config: str, *, rounds: int | None = None):
    """The server workflow of an NVFlare job for a gradleak config (``FedJob.to_server(controller_for(cfg))``)."""
    from gradleak.fl.engines.nvflare_bridge import GradleakController

    return GradleakController(config=str(config), builder=SERVER_BUILDER, num_rounds=int(rounds or 0))


# ------------------------------------------------------------------------------------------ merging clients' audits

def _rows_of(cid: Any, entry: dict) -> dict:
    """One client's outcome of one attack (a row :func:`gradleak.run.audit_judge.fold_clients` folds) from the entry
    of that client's own audit: its judgement (:data:`gradleak.run.audit_judge.ENTRY_KEYS`) and its client row."""
    from gradleak.run.audit_judge import ENTRY_KEYS

    if entry.get("failed") and not entry.get("per_client"):  # crashed on this client: named, never counted
        return {"client": cid, "failed": entry["failed"]}
    if "success" in entry:
        row = {k: entry[k] for k in ENTRY_KEYS if k in entry}
        own = (entry.get("per_client") or [{}])[0]
        row.update({k: v for k, v in own.items() if k != "client"})
        return {"client": cid, **row}
    if entry.get("applicable") is False:
        return {"client": cid, "refused": entry.get("reason", "")}
    return {"client": cid, "failed": entry.get("failed") or entry.get("reason", "")}


def merge_client_audits(results: dict[Any, dict], threat, not_run: Sequence[dict], server_round: int, *,
                        left_out: Sequence[str] = (), by: str = "--only") -> dict:
    """A round's ``audit.json`` from its clients' own audits ``{client: RoundAudit result}``: per attack, every
    client's row folded as the round audit folds them (the worst client's judgement on the entry), the verdict the
    worst level (``left_out``: applicable attacks ``by`` left out, named in the banner). The one entry shape of
    ``audit.json``."""
    from gradleak.run.audit import verdict_and_headline
    from gradleak.run.round_audit import fold_round

    skip = {e["name"] for e in not_run}
    order: list[str] = []
    per: dict[str, list[tuple[Any, dict]]] = {}
    for cid, res in results.items():
        for e in res["attacks"]:
            if e["name"] in skip:
                continue
            if e["name"] not in per:
                order.append(e["name"])
            per.setdefault(e["name"], []).append((cid, e))
    entries = []
    for name in order:
        first = per[name][0][1]
        entry = {"name": name, "reconstruction": first.get("reconstruction"), "applicable": True,
                 "threat": first.get("threat"), "seconds": sum(float(e.get("seconds", 0.0)) for _, e in per[name])}
        # the gate's word on the attack (an attack run under the server upgrade it needs is applicable only under it,
        # as gradleak audit and the round audit report it) and its full-strength variants
        entry.update({k: first[k] for k in ("applicable", "applicable_under", "threat_words", "upgrade", "reason",
                                            "variants") if k in first})
        fold_round(entry, [_rows_of(cid, e) for cid, e in per[name]], threat)  # the round audit's one fold
        entries.append(entry)
    verdict, headline = verdict_and_headline(entries, list(left_out), by)  # as the round audit and the CLI judge it
    return {"server_round": server_round, "verdict": verdict, "headline": headline, "aggregated": False, "note": "",
            "clients": sorted(results, key=str), "attacks": entries + list(not_run),
            "client_scores": {}, "seconds": sum(float(r.get("seconds", 0.0)) for r in results.values())}


def client_level(result: dict) -> str:
    """The worst level any attack reached on one client's own audit (``undefined`` when none was judged)."""
    from gradleak.evaluation.levels import level_rank

    levels = [e.get("level") for e in result["attacks"] if e.get("success") is not None and e.get("level")]
    return max(levels, key=level_rank, default="undefined")


# ------------------------------------------------------------------------------------------ the filter

class _AuditFilter:
    """What :class:`NVFlareAudit` does (its docstring: :func:`_make_audit_class`), without NVFlare's ``DXOFilter``
    base class, so it can live at module level while ``nvflare`` stays an optional import; the class built by
    :func:`_make_audit_class` puts ``DXOFilter`` under it."""

    def __init__(self, config: str, out_dir: str, attacks: list | None = None, truth: Any = "config",
                 block_at: str = "", lr: float = 0.0, device: str = "cpu", quiet: bool = False):
        from nvflare.apis.dxo import DataKind

        super().__init__(supported_data_kinds=[DataKind.WEIGHTS, DataKind.WEIGHT_DIFF],
                         data_kinds_to_filter=[DataKind.WEIGHTS, DataKind.WEIGHT_DIFF])
        if block_at and block_at not in BLOCK_LEVELS:
            raise BadInput("block_at", f"must be one of {', '.join(BLOCK_LEVELS)} (or empty), got {block_at!r}.",
                           "block e.g. uploads that leak at least strongly: block_at='strong'.")
        self.config, self.out_dir, self.attacks, self.truth = str(config), str(out_dir), attacks, truth
        self.block_at, self.lr, self.device, self.quiet = block_at, float(lr), device, bool(quiet)
        self._audit = None
        self._results: dict[int, dict[Any, dict]] = {}  # server round -> client -> its own audit
        self.blocked: list[dict] = []
        self.summary: dict[int, dict] = {}

    # -- the pieces
    def round_audit(self):
        """The :class:`~gradleak.run.round_audit.RoundAudit` every client is audited with (built on first use)."""
        if self._audit is None:
            from gradleak.run.round_audit import RoundAudit

            truth = self.truth
            if truth == "config":
                config = self.config
                truth = lambda _r: list(partitions(config))  # noqa: E731
            elif not truth:
                truth = None
            self._audit = RoundAudit(self.config, Path(self.out_dir), attacks=self.attacks, truth=truth,
                                     device=self.device, log=(lambda _m: None) if self.quiet else print)
        return self._audit

    def sent(self) -> dict[int, dict[str, torch.Tensor]]:
        return _SENT.setdefault(str(Path(self.out_dir).resolve()), {})

    def _direction(self, fl_ctx) -> str:
        from nvflare.apis.filter import FilterChainType, FilterContextKey
        from nvflare.apis.fl_constant import FilterKey, FLContextKey

        d = fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION)
        if d in (FilterKey.IN, FilterKey.OUT):
            return d
        chain = self.get_prop(FilterContextKey.CHAIN_TYPE)
        return FilterKey.OUT if chain == FilterChainType.TASK_DATA_CHAIN else FilterKey.IN

    # -- DXOFilter
    def process_dxo(self, dxo, shareable, fl_ctx):
        from nvflare.apis.dxo import DataKind
        from nvflare.apis.fl_constant import FilterKey
        from nvflare.app_common.app_constant import AppConstants

        r = shareable.get_header(AppConstants.CURRENT_ROUND, None)
        if self._direction(fl_ctx) == FilterKey.OUT:  # the task the server sends: remember the model
            if r is None:
                r = fl_ctx.get_prop(AppConstants.CURRENT_ROUND, None)
            if dxo.data_kind == DataKind.WEIGHTS and r is not None and int(r) not in self.sent():
                self.sent()[int(r)] = to_torch(dxo.data)
            return None
        self._audit_result(dxo, shareable, fl_ctx, r)
        return None

    def _audit_result(self, dxo, shareable, fl_ctx, r) -> None:
        """Audit one client's result on its own upload, write the round so far, and block it at ``block_at``."""
        from nvflare.apis.filter import ContentBlockedException

        from gradleak.evaluation.levels import level_rank
        from gradleak.run.round_audit import round_console

        audit, cid, site, rec = self._recorded_upload(dxo, shareable, fl_ctx, self._result_round(fl_ctx, r))
        server_round = rec.server_round
        t0 = time.perf_counter()
        mine = audit.audit(rec)  # this client, on its own upload
        mine["seconds"] = time.perf_counter() - t0
        got = self._results.setdefault(server_round, {})
        got[cid] = mine
        merged = merge_client_audits(got, audit.cfg.threat_model, audit.not_run, server_round,
                                     left_out=audit.left_out_names(), by=audit.only_by or "--only")
        level = client_level(mine)
        block = bool(self.block_at) and level_rank(level) >= level_rank(self.block_at)
        if block:
            self.blocked.append({"server_round": server_round, "client": cid, "site": site, "level": level})
        rdir, report = self._write_round(audit, merged, mine, server_round)
        if not self.quiet:  # this client's level, then the round so far answer first, as gradleak audit words it
            print(f"[nvflare audit] round {server_round} client {cid} ({site}): level {level}"
                  + (f" -- BLOCKED (block_at {self.block_at})" if block else ""))
            print(round_console(merged, rdir / "audit.json", report, "[nvflare audit]"))
        if block:
            raise ContentBlockedException(f"gradleak: the upload of client {cid} ({site}) in round {server_round} "
                                          f"leaks at level {level} (block_at {self.block_at}); see "
                                          f"{rdir / 'audit.json'}")

    def _result_round(self, fl_ctx, r) -> int:
        """The round of a client's result (its header, else the context's, else the last sent), which must have its
        sent model recorded."""
        from nvflare.app_common.app_constant import AppConstants

        sent_by_round = self.sent()
        if r is None:
            r = fl_ctx.get_prop(AppConstants.CURRENT_ROUND, None)
        if r is None and sent_by_round:
            r = max(sent_by_round)
        if r is None or int(r) not in sent_by_round:
            raise BadInput("NVFlareAudit", f"no model the server sent is recorded for round {r}: the audit needs "
                           "it (the attacks read the sent weights).", "add the same filter to the server's "
                           "task-data chain too (FilterType.TASK_DATA), as examples/nvflare/job.py does.")
        return int(r)

    def _recorded_upload(self, dxo, shareable, fl_ctx, r: int):
        """``(round audit, client id, site, RecordedRound)``: the client's result of round ``r`` as the update it
        holds against the model sent (a FULL result's update is ``(sent − new) / lr``)."""
        from nvflare.apis.dxo import DataKind
        from nvflare.apis.fl_constant import ReservedKey

        sent = self.sent()[r]
        meta = dict(dxo.meta or {})
        site = (shareable.get_peer_props() or {}).get(ReservedKey.IDENTITY_NAME)
        if not site and fl_ctx.get_peer_context() is not None:
            site = fl_ctx.get_peer_context().get_identity_name()
        cid = int(meta[META_CLIENT]) if META_CLIENT in meta else site_index(site)
        audit = self.round_audit()
        cfg = audit.cfg
        lr = float(meta.get(META_LR) or self.lr or cfg.fl.lr_at(r))
        params = to_torch(dxo.data)
        plan = cfg.client_plan()
        samples = int(meta.get(META_SAMPLES) or (plan[cid]["batch_size"] if cid < len(plan) else 1))
        upd = update_of(sent, params, params_type="FULL" if dxo.data_kind == DataKind.WEIGHTS else "DIFF",
                        algorithm=cfg.fl.algorithm, lr=lr, num_examples=samples, client_id=cid,
                        local_steps=int(meta.get(META_STEPS, 1)))
        return audit, cid, site, RecordedRound(r + 1, sent, [ClientReply(cid + 1, cid, params, samples, {})], [upd])

    def _write_round(self, audit, merged: dict, mine: dict, server_round: int):
        """Complete the round's merged audit (blocked uploads, the DP check, gradleak audit's report fields) and write
        ``round_<r>/audit.json``, its ``report.html`` and ``nvflare_audit.json``; returns (round folder, report)."""
        from gradleak.run.results import write_json_atomic
        from gradleak.run.round_audit import attach_artifacts, write_round

        merged["blocked"] = [b for b in self.blocked if b["server_round"] == server_round]
        merged["block_at"] = self.block_at or None
        if "dp_check" in mine:  # the declared DP mechanism replayed with canaries (RoundAudit.round_dp_check)
            merged["dp_check"] = mine["dp_check"]
        merged.update(audit.report_fields(merged["attacks"]))  # gradleak audit's report fields
        rdir = Path(self.out_dir) / f"round_{server_round}"
        for entry in merged["attacks"]:
            if "per_client" in entry:  # every client's PNGs so far, for the report's rows
                attach_artifacts(entry, rdir)
        report = write_round(rdir, merged)  # audit.json and report.html (gradleak audit's page), atomically
        self.summary[server_round] = {k: merged[k] for k in ("server_round", "verdict", "headline", "clients",
                                                             "blocked", "seconds")}
        write_json_atomic(Path(self.out_dir) / "nvflare_audit.json",
                          {"rounds": [self.summary[k] for k in sorted(self.summary)], "config": audit.raw})
        return rdir, report


def _make_audit_class():
    require_nvflare()
    from nvflare.apis.dxo_filter import DXOFilter

    class NVFlareAudit(_AuditFilter, DXOFilter):
        """gradleak's audit on an NVFlare server's filter chains (module docstring).

        ``config``: the gradleak config describing the federation (model, PEFT, data kind, threat, fl: the lr and
        algorithm the clients train with). ``out_dir``: where ``round_<r>/audit.json`` and ``nvflare_audit.json``
        go. ``attacks``: restrict the audit to these (default: every attack the config's gate accepts).
        ``truth``: ``"config"`` -- a simulation: the clients' partitions rebuilt from the config (:func:`partitions`)
        score and judge every attack; ``""`` -- a real deployment: the reconstructions are saved for inspection; or a
        callable ``server_round -> [(inputs, labels), ...]`` per client id (in-process). ``block_at``: ``partial`` |
        ``strong`` | ``exact`` raises ``ContentBlockedException`` for a result whose audit reaches that level
        (``""``: never block). ``lr``: the clients' lr when neither the result's meta nor the config says it
        (0: the config's). The constructor arguments are JSON values, as an NVFlare job's config needs."""

    NVFlareAudit.__module__ = __name__
    NVFlareAudit.__qualname__ = "NVFlareAudit"
    return NVFlareAudit


def __getattr__(name: str):  # the NVFlare filter class, built on first access (NVFlare is optional)
    if name == "NVFlareAudit":
        cls = _make_audit_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
