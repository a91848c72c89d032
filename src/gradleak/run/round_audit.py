"""The audit of one recorded round of a framework's federation (Flower, NVFlare): every applicable attack on each
client's own upload, scored against the client's data when a simulation knows it, and judged by the one judging
step the CLI audit uses (:func:`gradleak.run.audit_judge.judge`), with the one entry shape of ``audit.json``
(:func:`gradleak.run.audit_judge.client_row` per client, the worst client's judgement on the entry; docs/DESIGN.md §7).

* :func:`attack_view` — one attack on one view of the round, as the pipeline's trial body runs it (the public
  knowledge its threat grants, the evaluation step with the truth fields its kind needs), then :func:`judged_rows`:
  each client's metrics judged as ``gradleak audit`` judges them, or the reconstruction saved for inspection (no
  truth on a real server). A refused attack is ``refused``, a crashed one ``failed`` — never ``none``.
* :class:`RoundAudit` — an ``on_round`` callback over :class:`~gradleak.fl.recorded.RecordedRound`: every client of
  the round attacked on its own upload (the view's first update is the attacked one; the leakage kind: every client in
  one run, as the pipeline attacks it); under secure aggregation the one sum, against every client's data. It plans
  with ``gradleak audit``'s gate (:func:`gradleak.run.audit_plan.gate_attack`: an attack that needs a server capability a
  dishonest server can take -- public data: GradViT's prior, the BN inversion's dataset mean -- runs under that
  upgrade and counts only under it) and runs each attack at full strength
  (:func:`gradleak.run.audit_plan.full_strength_variants`, the most leaking variant is the evidence), so a round audit
  measures the attacks ``gradleak audit`` measures on the same config, at the same levels (the attacks that poison the
  weights the server sends are the exception: not run on a recorded honest round).
  Writes ``OUT/round_<r>/audit.json`` with the report's fields
  (:func:`gradleak.run.audit_words.report_context`) and ``OUT/round_<r>/report.html`` beside it, by the report code of
  ``gradleak audit`` (:func:`write_round`; ``gradleak report OUT/round_<r>/audit.json`` rebuilds it). The Flower audit
  (:class:`gradleak.integrations.flower.FlowerAudit`) adds ``--advise`` to it; the NVFlare result filter
  (:mod:`gradleak.integrations.nvflare`) calls it per round.
* When the config declares a DP mechanism (and ``audit.dp_check`` is not false), the first audited round also replays
  the declared mechanism with canaries (:meth:`RoundAudit.round_dp_check`: :func:`gradleak.run.dp_check.dp_check`,
  the check ``gradleak audit`` runs, for one round from the round's sent weights): ``dp_check`` in every round's
  ``audit.json`` and ``OUT/round_<r>/dp_check.json`` (docs/DESIGN.md §6, the DP check).
* The console speaks as ``gradleak audit``: each attack's line in its level's words
  (:func:`gradleak.run.audit_report.attack_line`), and each written round answer first (:func:`round_console`): the
  banner's sentence -- the worst level, the attack, the client, the measurement beside its null -- then the audit's
  short table (:func:`gradleak.run.audit_report.console_table`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gradleak.errors import BadInput
from gradleak.fl.recorded import RecordedRound, view_of

def raw_config(config) -> dict:
    """A gradleak config (a path or a mapping) as a raw mapping (a copy)."""
    from gradleak.config.loading import load_yaml

    return load_yaml(config) if isinstance(config, (str, Path)) else copy.deepcopy(dict(config))


def validated_config(config, who: str = "the federation"):
    """The validated experiment of a framework app's gradleak config (``audit:`` dropped; ``attack.name`` required:
    it fixes the model's dtype the app trains in)."""
    from gradleak.run.runner import validate

    raw = raw_config(config)
    raw.pop("audit", None)
    if not (raw.get("attack") or {}).get("name"):
        raise BadInput("attack.name", f"{who}'s config names no attack, so its model's dtype is not fixed.",
                       "name the attack whose setting the app models (e.g. attack: {name: lora_span}).")
    return validate(raw)[1]


def save_reconstruction(rec, out_dir: Path, tokenizer=None) -> None:
    """What an attack produced, for a human to inspect when nothing can score it (no ground truth): images as a PNG
    grid, token sequences decoded, scores as numbers."""
    from gradleak.run.results import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    data, saved = rec.data, {"metrics": {k: float(v) for k, v in (getattr(rec, "metrics", {}) or {}).items()}}
    if isinstance(data, dict) and isinstance(data.get("images"), torch.Tensor):
        from gradleak.report import save_image_grid

        save_image_grid(data["images"].detach().float().clamp(0, 1).cpu(), out_dir / "images.png")
        saved["images"] = "images.png"
    elif isinstance(data, dict) and "scores" in data:
        saved["scores"] = {str(k): [float(x) for x in v] for k, v in dict(data["scores"]).items()}
    elif isinstance(data, (list, tuple)) and tokenizer is not None:
        saved["texts"] = [tokenizer.decode(list(s), skip_special_tokens=True).strip() for s in data]
    write_json_atomic(out_dir / "reconstruction.json", saved)


def attack_view(name: str, cfg, handle, view, truth: dict | None, *, device, null_pool=None, out_dir: Path,
                public: dict | None = None, truth_fields: dict | None = None) -> dict:
    """Attack ``name`` (validated experiment ``cfg``) on ``view`` of ``handle.model``, as the pipeline's trial body
    does (:func:`gradleak.run.pipeline.run_experiment`: the public knowledge the threat model grants -- ``public``,
    e.g. the public images of ``data.public`` -- the evaluation step :func:`~gradleak.run.pipeline.evaluate_update`
    with ``truth_fields``, e.g. the leakage kind's per-client data or membership): ``{"metrics": ...}`` when ``truth``
    is known, else ``{"success": None}`` with the reconstruction saved under ``out_dir``; ``{"refused": why}`` /
    ``{"failed": error}`` when it could not run."""
    from gradleak.attacks.base import AttackContext
    from gradleak.run.pipeline import evaluate_update, public_protocol

    A = cfg.attack_cls
    threat = cfg.threat_model
    public = dict(public or {})
    if threat.knows_batch_size:
        public["batch_size"] = view.updates[0].num_samples
    ctx = AttackContext(seed=cfg.seed, device=device, threat=threat, fl=public_protocol(cfg), public=public)
    try:
        attack = A.from_config(cfg.attack_cfg, ctx)
        attack.prepare(handle.model, threat)
        out = attack.reconstruct(view)
        if truth is None:
            save_reconstruction(out, out_dir, handle.tokenizer)
            return {"success": None}
        ev = evaluate_update(out, truth, handle=handle, cfg=cfg, out_dir=out_dir, label=0, null_pool=null_pool,
                             **(truth_fields or {}))
        return {"metrics": ev.metrics, "warning": (out.info or {}).get("warning")}
    except BadInput as err:
        return {"refused": str(err)}
    except Exception as err:  # noqa: BLE001 -- one attack's crash must not stop the federation's audit
        return {"failed": f"{type(err).__name__}: {err}"}


def judged_rows(kind: str, client, res: dict, cfg, n_truth: int | None = None) -> list[dict]:
    """The per-client rows of one attacked view's result (:func:`attack_view`): each client's metrics
    (:func:`gradleak.run.answer.client_metric_sets`: a unit that scores every client in one run -- the leakage kind --
    grades every client of the run, the other kinds the attacked ``client``) judged by
    :func:`gradleak.run.audit_judge.judge`, as ``gradleak audit`` judges them; a unit whose ``n_total`` counts the batch's
    private samples has it from the truth (``n_truth``)."""
    from gradleak.evaluation import unit
    from gradleak.run.answer import client_metric_sets
    from gradleak.run.audit_judge import judge

    if "metrics" not in res:
        return [{"client": client, **res}]
    u = unit(kind)
    sets = client_metric_sets(kind, res["metrics"])
    rows = []
    for c, mets in sets:
        one = judge(kind, mets, cfg)
        if one.n_total is not None and u.counts_batch_samples and n_truth is not None:
            one = dc_replace(one, n_total=int(n_truth))
        rows.append({"client": c if u.scores_every_client else client, **one.as_dict(),
                     **({"warnings": [str(res["warning"])]} if res.get("warning") else {})})
    return rows


def _summed(threat):
    return dc_replace(threat, individual_updates=False)


def fold_round(entry: dict, rows: list[dict], threat) -> None:
    """Put the per-client outcomes ``rows`` (``{"client", ...}``: :func:`judged_rows`) on ``entry`` in the one shape
    (:func:`gradleak.run.audit_judge.fold_clients`: ``per_client``, the most leaking client's judgement,
    ``worst_client``), with the round's sums (any client leaking; the private samples exact over every client); an
    attack that ran on no client is not applicable (refused) or failed, with the reason."""
    from gradleak.run.answer import server_words
    from gradleak.run.audit_judge import fold_clients

    ran = [o for o in rows if "success" in o]
    if not ran:
        first = rows[0]
        entry.update({"applicable": "refused" not in first, "reason": first.get("refused") or first.get("failed", "")})
        if "failed" in first:  # a crash measured nothing: undefined, never none (as gradleak audit records it)
            entry.update({"failed": first["failed"], "level": "undefined", "success": False, "undefined": True,
                          "value": None, "rule": "the run failed: nothing was measured",
                          "reason": f"the run failed: {first['failed']}"})
        return
    if all(o["success"] is None for o in ran):  # ran, but nothing on the server can score it: undefined
        why = "no ground truth on the server: the reconstructions are saved for inspection; see the clients' own scores"
        entry.update({"success": None, "level": "undefined", "undefined": True, "value": None, "rule": why,
                      "reason": why,
                      "per_client": [{"client": o["client"], "level": "undefined", "success": None} for o in ran]})
        return
    fold_clients(entry, ran)
    entry.setdefault("threat_words", server_words(threat))  # the gate's words (an upgraded server) stand
    entry["success"] = any(o["success"] for o in ran)
    if all(o.get("n_success") is not None for o in ran):
        entry["n_success"] = sum(o["n_success"] for o in ran)
        entry["n_total"] = sum(o["n_total"] for o in ran)
    skipped = [o for o in rows if "success" not in o]
    if skipped:  # a client whose attack crashed or was refused: named, never counted as "none"
        entry["clients_not_scored"] = [{"client": o["client"], "reason": o.get("failed") or o.get("refused", "")}
                                       for o in skipped]


class RoundAudit:
    """gradleak's attacks on every audited round of a framework's federation (module docstring).

    ``config`` is the gradleak config that describes the federation (model, PEFT, data kind, threat, fl); its
    ``attack`` names the setting the app models, and every registered attack the config's gate accepts is run
    (``attacks=[...]`` restricts them). Attacks that poison the weights the server sends cannot run after the fact:
    they are listed as not run. ``truth(server_round) -> [(inputs, labels), ...]`` (per client id, the pipeline's
    form: images in [0, 1], or texts) is what a *simulation* knows; with it every attack is scored and judged as
    ``gradleak audit`` judges it. Without it (a real deployment) the reconstructions are saved for inspection.
    Calling it with a :class:`~gradleak.fl.recorded.RecordedRound` returns the round's result and writes
    ``OUT/round_<r>/audit.json``."""

    who = "the federation"
    log_prefix = "[round audit]"

    def __init__(self, config, out_dir, *, attacks: Sequence[str] | None = None,
                 truth: Callable[[int], list] | None = None, device: str = "cpu", log: Callable[[str], Any] = print,
                 command: str = ""):
        from gradleak.registry import ATTACKS
        from gradleak.run.audit_plan import attack_names, full_strength_variants, gate_attack, left_out_split
        from gradleak.run.pipeline import build_handle
        from gradleak.run.runner import validate

        self.raw = raw_config(config)
        self.cfg = validated_config(self.raw, self.who)
        self.config_path = str(config) if isinstance(config, (str, Path)) else None
        self.command = command or (f"{type(self).__name__}({self.config_path or 'a config mapping'}, {out_dir}) on a "
                                   "live federation: rerun the federation with it to reproduce")
        self._context: dict | None = None  # the report's fields of every round (report_fields)
        self._dp: dict | None | bool = False  # the DP check's replay (round_dp_check; False: not run yet)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.truth, self.log, self.device = truth, log, torch.device(device)
        names = list(attacks) if attacks else attack_names()
        unknown = sorted(set(names) - set(ATTACKS.names()))
        if unknown:
            raise BadInput("attacks", f"unknown attack(s) {', '.join(unknown)}.", f"choose from {', '.join(ATTACKS.names())}.")
        self.plans, self.not_run = [], []
        self.runs: dict[str, dict] = {}  # attack -> its gate entry, full-strength variants and their validated configs
        for name in names:
            # the gate `gradleak audit` plans with (gate_attack): under the configured threat, or under the smallest
            # server upgrade the attack needs (public data a server can hold: GradViT's prior, the BN inversion's
            # dataset mean), reported as gradleak audit reports it
            entry, plan, err = gate_attack(self.raw, name)
            if plan is None:
                self.not_run.append({"name": name, "applicable": False,
                                     "reason": entry.get("reason") or (str(err) if err is not None else "refused")})
                continue
            _, cand, cfg, A = plan
            if A.rewrites_weights:
                self.not_run.append({"name": name, "applicable": False, "reason": "poisons the weights the server "
                                     "sends, which a recorded honest federation did not do; run it through the "
                                     "engine's server hook (gradleak run with fl.engine set)"})
                continue
            variants = full_strength_variants(A, cand, cfg)  # as gradleak audit runs it: at full strength
            cfgs = [cfg] + [validate({**cand, "attack": {**cand["attack"], **v}})[1] for v in variants[1:]]
            self.plans.append((name, cfg))
            self.runs[name] = {"entry": {k: entry[k] for k in ("applicable", "applicable_under", "threat",
                                                               "threat_words", "upgrade", "reason") if k in entry},
                               "variants": variants, "cfgs": cfgs}
        # attacks=[...] left the others out: each checked by the gate (validated, none run), so the banner and the
        # report say which of them could have run here (an audit of some attacks must not read as an audit of all)
        self.only_by = f"the audit's attacks={names}" if attacks else None
        self.left_out = left_out_split(self.raw, names) if attacks else {"applicable": [], "not_applicable": []}
        if not self.plans:
            raise BadInput("attacks", "no attack applies to this federation's config: "
                           + "; ".join(f"{e['name']}: {e['reason']}" for e in self.not_run[:4]),
                           "check the config's model / PEFT kind / threat, or name attacks that apply.")
        self.handle, _ = build_handle(self.cfg)
        self.handle.model.to(self.device)
        self.summary: list[dict] = []
        self.null_pool = None  # chance, for the levels (public samples of the config's data no client holds)
        self._data: dict[str, Any] = {}  # each attack's data (its public set and prior), built on first use
        if truth is not None:
            from gradleak.modalities import modality_data

            try:
                self.null_pool = modality_data(self.cfg).null_pool(0) if self.cfg.metrics.null else None
            except (BadInput, OSError, ValueError) as err:
                self.log(f"{self.log_prefix} no null pool ({err}): levels will be undefined")

    def data_of(self, cfg):
        """The modality's data of one attack's validated config (what the pipeline builds for that run: the public
        set its threat grants, the prior image it wants, held-out validation and non-member samples), or None when
        it cannot be built (the attack then runs without it and says what it missed)."""
        from gradleak.modalities import modality_of

        key = f"{cfg.attack.name}|{cfg.threat_model.capability}|{cfg.data.model_dump_json()}"
        if key not in self._data:
            try:
                data = modality_of(cfg).data(cfg)
                data.clients(0, cfg.model.num_classes)  # the one draw its held-out chunks (prior, validation) follow
                self._data[key] = data
            except (BadInput, OSError, ValueError) as err:
                self.log(f"{self.log_prefix} {cfg.attack.name}: no data of its own ({err})")
                self._data[key] = None
        return self._data[key]

    def null_pool_of(self, cfg):
        """Chance for the levels of one attack's run, as the pipeline draws it for that run (its data's held-out
        samples no client holds: :meth:`data_of`); the config's pool when the attack's data cannot be built; None
        for a unit that draws no pool (the membership kind: its null is the candidates') or with ``metrics.null``
        off."""
        from gradleak.evaluation import unit

        if not cfg.metrics.null or not unit(cfg.attack_cls.reconstruction).draws_null_pool:
            return None
        data = self.data_of(cfg)
        if data is None:
            return self.null_pool
        key = ("null", f"{cfg.attack.name}|{cfg.threat_model.capability}|{cfg.data.model_dump_json()}")
        if key not in self._data:
            try:
                self._data[key] = data.null_pool(0)
            except (BadInput, OSError, ValueError) as err:
                self.log(f"{self.log_prefix} {cfg.attack.name}: no null pool of its own ({err})")
                self._data[key] = self.null_pool
        return self._data[key]

    def targets(self, rec: RecordedRound, cfg=None) -> list[tuple[Any, Any, dict | None]]:
        """``(client label, view, truth)`` per attacked update of ``rec`` for the attack of ``cfg`` (default: the
        config's): each client on its own upload (first in its view) when the attack's evaluation unit grades clients
        apart, as the pipeline's :func:`~gradleak.run.pipeline.attacked_clients` picks them; else the view as recorded
        (the leakage kind: every client of the round in one run), or the one sum against every client's data.
        The truth carries what the pipeline's evaluation step gets beside it (``_fields``: the unit's
        ``truth_fields``, e.g. membership labels, the leakage kind's per-client data) and the view what the pipeline's
        server is granted (the prior image; the unit's granted knowledge, e.g. the membership candidates)."""
        from gradleak.evaluation import unit
        from gradleak.fl.core import default_classification_loss
        from gradleak.modalities import modality_of
        from gradleak.run.pipeline import always_public, clients_and_truth

        h, base, model = self.handle, cfg or self.cfg, self.handle.model
        kind = base.attack_cls.reconstruction
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in rec.sent.items():
                if k in params:
                    params[k].copy_(v.to(device=params[k].device, dtype=params[k].dtype))
        threat = base.threat_model
        batches = self.truth(rec.server_round) if self.truth is not None else None
        data = self.data_of(base) if batches is not None else None
        victims = [None] if (rec.aggregated or not threat.individual_updates) else list(range(len(rec.updates)))
        if victims != [None] and not (base.metrics.attack_clients == "all" and unit(kind).per_client):
            victims = victims[:1]  # one run over the round as recorded (e.g. the leakage kind: per client inside)
        always = always_public(h, base)
        out = []
        for v in victims:
            r_v = rec if not v else RecordedRound(rec.server_round, rec.sent, rec.replies,
                                                  rec.updates[v:] + rec.updates[:v], rec.aggregated,
                                                  rec.aggregate, rec.note)
            knowledge, truth = {}, None
            if batches is not None:
                ids = [u.client_id for u in r_v.updates]
                b_v = batches if v is None else [batches[i] for i in ids] + [b for i, b in enumerate(batches)
                                                                            if i not in ids]
                _, truth = clients_and_truth(h, b_v, h.loss_fn or default_classification_loss, self.device,
                                             threat if v is not None else _summed(threat), base)
                knowledge = truth.pop("_knowledge")
                fields: dict[str, Any] = {}
                if data is not None:
                    modality_of(base).trial_knowledge(base, data, knowledge)  # e.g. a prior image the server holds
                    granted, extra = unit(kind).truth_fields(data, 0, batches, threat, base)
                    knowledge.update(granted)  # e.g. the membership candidates
                    fields.update(extra)  # e.g. membership labels, every client's data (the leakage kind)
                truth["_fields"] = fields
            view = view_of([r_v], model=model, threat=threat, knowledge=knowledge, always_public=always)
            out.append(("sum" if v is None else rec.updates[v].client_id, view, truth))
        return out

    def audit(self, rec: RecordedRound) -> dict:
        """The round's result (not written): every plan on every target, judged, with the verdict."""
        from gradleak.run.audit_judge import verdict_and_headline
        from gradleak.run.audit_report import attack_line

        t_round = time.perf_counter()
        threat = self.cfg.threat_model
        rdir = self.out / f"round_{rec.server_round}"
        entries = []
        for name, _ in self.plans:
            entries.append(self.audit_attack(name, self.runs[name], rec, rdir, threat))
            self.log(f"{self.log_prefix} round {rec.server_round} {attack_line(entries[-1])}")
        # the CLI's verdict over every attack that ran (an unscored one -- no ground truth -- is undefined)
        verdict, headline = verdict_and_headline(entries, self.left_out_names(), self.only_by or "--only")
        dp = self.round_dp_check(rec)
        return {"server_round": rec.server_round, "verdict": verdict, "headline": headline,
                "aggregated": rec.aggregated, "note": rec.note, "attacks": entries + self.not_run,
                "client_scores": {str(k): v for k, v in rec.client_metrics.items() if v},
                **({"dp_check": dp} if dp is not None else {}),
                "seconds": time.perf_counter() - t_round, **self.report_fields(entries)}

    def audit_attack(self, name: str, run: dict, rec: RecordedRound, rdir: Path, threat) -> dict:
        """One attack's entry for round ``rec``: every full-strength variant
        (:func:`gradleak.run.audit_plan.full_strength_variants`, the parameter sets ``gradleak audit`` runs) on every
        target of the round, under the threat the gate ran it under (the configured one, or the smallest server
        upgrade: then applicable only under it, as gradleak audit reports it); the most leaking variant's clients are
        the entry's (:func:`fold_round`), each variant's worst level and client rows in ``per_variant`` (a client's
        own audit, e.g. :func:`gradleak.integrations.flower.client_scorer`, takes its own most leaking variant: one
        of these rows)."""
        from gradleak.evaluation import unit
        from gradleak.evaluation.levels import leak_rank
        from gradleak.modalities import modality_of
        from gradleak.run.audit_judge import client_row

        cfgs, variants = run["cfgs"], run["variants"]
        kind = cfgs[0].attack_cls.reconstruction
        entry = {"name": name, "reconstruction": kind, "applicable": True, "threat": threat.capability,
                 **run["entry"]}
        t0 = time.perf_counter()
        by_variant = []
        for k, cfg in enumerate(cfgs):
            rows = []
            for cid, view, truth in self.targets(rec, cfg):
                fields = truth.pop("_fields", {}) if truth is not None else {}
                data = self.data_of(cfg)  # public knowledge (data.public): the server holds it with or without truth
                public = dict(modality_of(cfg).attack_public(cfg, data, cfg.threat_model)) if data is not None else {}
                out_dir = rdir / variant_folder(name, k) / f"client_{cid}"
                res = attack_view(name, cfg, self.handle, view, truth, device=self.device,
                                  null_pool=self.null_pool_of(cfg) if truth is not None else None,
                                  out_dir=out_dir, public=public, truth_fields=fields)
                rows += judged_rows(kind, cid, res, cfg, len(truth["labels"]) if truth is not None else None)
            if unit(kind).scores_every_client and not rec.aggregated:
                # the leakage kind grades every client of the federation in one run; a round that holds only some
                # clients' uploads (the NVFlare filter audits each client on its own) is graded on those alone (the
                # others read as withheld: the prior, RDLV 0, which is not what they sent)
                sent = {u.client_id for u in rec.updates}
                rows = [r for r in rows if r["client"] in sent] or rows
            by_variant.append(rows)
        entry["seconds"] = time.perf_counter() - t0
        ranked = [(k, r) for k, rows in enumerate(by_variant) for r in rows if "level" in r]
        k = max(ranked, key=lambda t: leak_rank(t[1]))[0] if ranked else 0
        fold_round(entry, by_variant[k], cfgs[k].threat_model)
        if len(variants) > 1:
            entry["variants"] = variants
            entry["worst_variant"] = variants[k] or "as configured"
            entry["per_variant"] = []
            for kk, rows in enumerate(by_variant):
                judged = [r for r in rows if "level" in r]
                if judged:  # each variant's worst level, and every client's row of it
                    w = max(judged, key=leak_rank)
                    entry["per_variant"].append({"variant": variants[kk] or "as configured", "seed": cfgs[kk].seed,
                                                 "level": w["level"], "value": w.get("value"),
                                                 "per_client": [client_row(r["client"], r) for r in judged]})
        attach_artifacts(entry, rdir, k)
        return entry

    def round_dp_check(self, rec: RecordedRound) -> dict | None:
        """The DP check of the declared mechanism, replayed once (on the first audited round; later rounds carry the
        same result): :func:`gradleak.run.dp_check.dp_check` -- the code ``gradleak audit`` runs, no second
        implementation -- on the audited config (its first planned attack's, as :func:`gradleak.run.audit.dp_check_job`
        takes it) for one round from ``rec``'s sent weights, with ``audit.dp_check``'s canaries. None when the config
        declares no DP mechanism or sets ``audit.dp_check: false``; a crashed check is ``undefined`` with its error
        (:func:`gradleak.run.audit.dp_check_entry`), never a pass. Also written to ``OUT/round_<r>/dp_check.json``."""
        from gradleak.run.audit import dp_check_entry
        from gradleak.run.dp_check import declares_dp, dp_check, dp_section
        from gradleak.run.results import write_json_atomic
        from gradleak.run.runner import validate

        if self._dp is False:
            self._dp = None
            opts = dp_section((self.raw.get("audit") or {}).get("dp_check"))
            name, cfg = self.plans[0]
            if opts is not None and declares_dp(cfg):
                t0 = time.perf_counter()
                try:
                    from gradleak.run.audit_plan import candidate

                    raw = copy.deepcopy(self.raw)
                    raw.setdefault("fl", {})["rounds"] = 1  # the recorded round, replayed
                    _, one = validate(candidate(raw, name))
                    res = {"dp_check": dp_check(one, self.device, canaries=opts["canaries"], sent=rec.sent)}
                except Exception as err:  # noqa: BLE001 -- a crashed check (or a BadInput) is undefined, never a pass
                    res = {"error": f"{type(err).__name__}: {err}"}
                res["seconds"] = time.perf_counter() - t0
                self._dp = {**dp_check_entry(res), "replayed_round": rec.server_round}
                self.log(f"{self.log_prefix} dp_check (round {rec.server_round} replayed with canaries): "
                         f"{self._dp['verdict'].upper()} -- {self._dp['sentence']}")
        if self._dp is not None:
            rdir = self.out / f"round_{rec.server_round}"
            rdir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(rdir / "dp_check.json", {"dp_check": self._dp})
        return self._dp

    def left_out_names(self) -> list[str]:
        """The attacks ``attacks=[...]`` left out that would run here (named in the banner)."""
        return [x["name"] for x in self.left_out["applicable"]]

    def report_fields(self, entries: list[dict]) -> dict:
        """What a round's ``audit.json`` holds for the report beside its attacks (``gradleak audit``'s fields,
        :func:`gradleak.run.audit_words.report_context`, computed once), with the attacks not run and the undefined ones."""
        if self._context is None:
            from gradleak.run.audit_words import report_context
            from gradleak.run.evidence import evidence_record  # never raises

            self._context = report_context(self.raw, self.cfg, self.command)
            self._context["evidence_record"] = evidence_record(self.raw, self.cfg, [c for _, c in self.plans],
                                                               [self.cfg.seed], self.command, self.config_path)
        return {**self._context, "only_by": self.only_by, "left_out": self.left_out,
                "not_tested": [f"{x['name']}: applicable (under {x['threat_words']}), not run: left out by "
                               f"{self.only_by}" for x in self.left_out["applicable"]],
                "not_applicable": [f"{e['name']}: {e['reason']}" for e in self.not_run]
                                  + [f"{x['name']}: {x['reason']}" for x in self.left_out["not_applicable"]],
                "undefined": [f"{e['name']}: {e.get('reason') or e.get('rule', '')}" for e in entries
                              if e.get("level") == "undefined"]}

    def write(self, result: dict, summary_name: str = "round_audit.json") -> None:
        """``OUT/round_<r>/audit.json`` and ``report.html`` (:func:`write_round`), the summary of every audited round
        (``OUT/<summary_name>``), atomically; then the round's console (:func:`round_console`)."""
        from gradleak.run.results import write_json_atomic

        rdir = self.out / f"round_{result['server_round']}"
        report = write_round(rdir, result)
        self.log(round_console(result, rdir / "audit.json", report, self.log_prefix))
        self.summary.append({k: result[k] for k in ("server_round", "verdict", "headline", "aggregated", "seconds")}
                            | {"values": {e["name"]: e.get("value") for e in result["attacks"] if e not in self.not_run},
                               "client_scores": result["client_scores"]}
                            | ({"advice": {k: result["advice"].get(k) for k in ("sentence", "recommendation")}}
                               if "advice" in result else {}))
        write_json_atomic(self.out / summary_name, {"rounds": self.summary, "config": self.raw})

    def __call__(self, rec: RecordedRound) -> dict:
        result = self.audit(rec)
        self.write(result)
        return result


def variant_folder(name: str, k: int = 0) -> str:
    """An attack's folder in a round's folder: ``<attack>`` for its run as configured, ``<attack>/variant<k>`` for
    its ``k``-th full-strength variant (as ``gradleak audit`` lays out ``attacks/<attack>/variant<k>``)."""
    return name + (f"/variant{k}" if k else "")


def attach_artifacts(entry: dict, rdir: Path, variant: int = 0) -> None:
    """The PNGs an attack wrote for the clients on ``entry`` (``rdir/<attack>/[variant<k>/]client_<c>/``: each
    client's originals beside its reconstruction where the truth is known, the saved reconstruction where it is not;
    ``variant``: the full-strength variant the entry's clients come from), as ``gradleak audit``'s entries list them:
    ``out`` (the attack's folder, relative to the round's) and ``artifacts`` (relative to ``out``), so the report
    shows each client's row. Clients not on the entry are not listed."""
    clients = {str(c.get("client")) for c in entry.get("per_client") or []}
    out = variant_folder(entry["name"], variant)
    folder = Path(rdir) / out
    pngs = sorted(p.relative_to(folder).as_posix() for p in folder.glob("client_*/*.png")
                  if p.parent.name.removeprefix("client_") in clients)
    if pngs:
        entry["out"], entry["artifacts"] = out, pngs


def write_round(rdir: Path, result: dict) -> Path:
    """A round's ``audit.json`` and its ``report.html`` in ``rdir``, both atomically; the page is ``gradleak audit``'s
    own (:func:`gradleak.run.audit_report.write_audit_report`, one renderer). Returns the report's path."""
    from gradleak.run.audit_report import write_audit_report
    from gradleak.run.results import write_json_atomic

    rdir = Path(rdir)
    rdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(rdir / "audit.json", result)
    return write_audit_report(result, rdir)


def round_console(result: dict, audit_path: Path, report: Path, prefix: str = "[round audit]",
                  width: int | None = None) -> str:
    """A written round's console, answer first: the banner's sentence (the verdict, the worst level, the attack and
    client, the measurement that decided it beside its null's 99th percentile and p-value), then the short table
    ``gradleak audit`` prints (:func:`gradleak.run.audit_report.console_table`: each attack's level in the CLI's
    words), then where the report is. Plain text (no colour), ``width`` columns (default: the terminal's)."""
    import io
    import shutil

    from rich.console import Console

    from gradleak.run.audit_report import console_table

    buf = io.StringIO()
    con = Console(file=buf, width=width or shutil.get_terminal_size((120, 24)).columns, color_system=None,
                  highlight=False, markup=False, emoji=False)
    con.print(f"{prefix} round {result['server_round']}: {result['headline']}", soft_wrap=True)
    con.print(console_table(result, f"round {result['server_round']} -> {audit_path}"))
    con.print(f"report: {report}", soft_wrap=True)
    return buf.getvalue().rstrip("\n")
