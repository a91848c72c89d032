"""Every config field an attack run depends on changes its resume key, so a rerun into the same ``--out`` with that
field changed reruns the run instead of reusing the old one (the ledger ``OUT/attacks/runs.jsonl`` of the one
resumable cell loop, keyed by :func:`gradleak.run.audit.run_key`; docs/ARCHITECTURE.md, ``run/cells.py``).

The fields are enumerated, not listed: every leaf of the validated experiment config (every default included:
``seed``, ``data.*``, ``model.*``, ``peft.*``, ``fl.*`` with the engines' sections, ``threat.*``, ``defenses``
entries and their parameters, the training-time ``defense``, ``metrics.*``) and every parameter of the attack, on
the shipped undefended and DP audit configs. Each leaf is changed in the run's config and the run goes through the
audit's own cell loop (:func:`gradleak.run.audit._run_jobs`, the attack itself replaced by a recorder): the changed
run must rerun under a new key. The ``audit:`` section's fields are checked through ``run_audit`` itself; those that
cannot change an attack run are listed with the reason (:data:`NOT_IN_RUN_KEY`). The runs themselves are recorded,
not executed, so the file takes seconds."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from gradleak.run import audit as mod

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["configs/audit/text_adapters.yaml", "configs/audit/text_dp_gaussian.yaml"]

#: fields of the ``audit:`` section that do not enter an attack run's config, each with the reason: they cannot
#: change an attack run's result, so they must not change its key (a changed key would only redo the same run)
NOT_IN_RUN_KEY = {
    "audit.advise": "--advise's search runs audits of its own (OUT/advise/), after the audited runs",
    "audit.budget": "bounds --advise's search only",
    "audit.utility_rounds": "--advise's accuracy runs only (metrics.utility is off in every attack run)",
    "audit.dp_check": "the DP check's own job (its key: tested below), not an attack run",
}


class _Stop(Exception):
    pass


def _quiet(_m):
    return None


def _raw(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def _jobs(monkeypatch, tmp_path: Path, raw: dict, sets: list[str], only=("utr",)) -> list[tuple]:
    """The jobs ``run_audit`` hands to its cell loop for ``raw`` + ``sets`` (caught before anything runs)."""
    got = {}

    def grab(out, jobs, workers, log=print):
        got["jobs"] = jobs
        raise _Stop

    with monkeypatch.context() as m:
        m.setattr(mod, "_run_jobs", grab)
        with pytest.raises(_Stop):
            mod.run_audit(copy.deepcopy(raw), tmp_path / "plan", sets, only=list(only), log=_quiet)
    return got["jobs"]


def _leaves(x, path=()):
    """``(path, value)`` of every leaf of a dumped config (lists of mappings: entry by entry)."""
    if isinstance(x, dict) and x:
        for k, v in x.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(x, list) and x and all(isinstance(i, dict) for i in x):
        yield path, x  # the list itself (an entry removed)
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    else:
        yield path, x


def _changed(v):
    """A value of a leaf other than ``v`` (the key is a hash of the run's config: any other value must change it)."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 2 + 1
    if isinstance(v, str):
        return v + "-changed"
    if v is None:
        return 1
    if isinstance(v, list):
        return v + [{"name": "gaussian_noise", "params": {"std": 0.01}}] if not v else v[:-1]
    if isinstance(v, dict):
        return {"changed": 1}
    raise AssertionError(f"no change for a leaf of type {type(v).__name__}")


def _set(cfg: dict, path: tuple, value) -> dict:
    """``cfg`` (a run's raw config) with ``path`` set to ``value``, the sections on the way made where the raw config
    leaves them to their defaults (a list entry: the validated config's entry)."""
    out = copy.deepcopy(cfg)
    node = out
    for k in path[:-1]:
        if not isinstance(k, int) and node.get(k) is None:
            node[k] = {}
        node = node[k]
    node[path[-1]] = value
    return out


def _fields(cand: dict) -> list[tuple[tuple, object]]:
    """Every field the run depends on: each leaf of the validated config (defaults included) and each attack
    parameter, at its path in the run's raw config (attack parameters sit flat under ``attack``)."""
    from gradleak.run.runner import validate

    _, cfg = validate(copy.deepcopy(cand))
    dump = cfg.model_dump(mode="json")
    dump.pop("attack")  # its parameters come from the attack's own config, below
    out = list(_leaves(dump))
    out += [(("attack", "name"), cand["attack"]["name"])]
    out += [(("attack", k), v) for k, v in cfg.attack_cfg.model_dump(mode="json").items()]
    return out


def _runs(monkeypatch, out: Path, jobs: list[tuple]) -> tuple[list[str], list[str]]:
    """The audit's cell loop over ``jobs`` into ``out`` (each attack run recorded, not executed): ``(the jobs that
    ran, the ledger's cell ids)``."""
    ran = []

    def record(name, cand, out_dir, device):
        ran.append(name)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "results.json").write_text("{}")
        return {"metrics": {}, "artifacts": [], "details": {}, "seconds": 0.0}

    with monkeypatch.context() as m:
        m.setattr(mod, "_run_one", record)
        mod._run_jobs(out, jobs, 1, _quiet)
    ledger = [json.loads(x) for x in (out / mod.RUN_LEDGER).read_text().splitlines() if x.strip()]
    return ran, [r["cell"] for r in ledger]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_field_of_a_run_changes_its_key_and_reruns_it(config, monkeypatch, tmp_path):
    """Each leaf of the run's validated config and each attack parameter, changed in the run's config: the run
    reruns into the same ``--out`` under a new key (never the old run's results); unchanged, it is reused."""
    job, cand, folder, device = _jobs(monkeypatch, tmp_path, _raw(config), [])[-1]  # utr, as configured
    rel = Path(folder).relative_to(tmp_path / "plan")
    fields = _fields(cand)
    names = {".".join(map(str, p)) for p, _ in fields}
    # the sections named in the brief are all enumerated (a schema change that drops one shows here)
    for must in ("seed", "data.seed", "data.batch_size", "model.name", "peft.kind", "fl.algorithm", "fl.lr",
                 "fl.engine", "fl.flower.reply", "fl.nvflare.reply", "threat.preset", "threat.public_data",
                 "defenses", "defense.name", "metrics.null_draws", "attack.name", "attack.rank_rtol", "attack.noise"):
        assert must in names, must
    if "dp_gaussian" in config:
        assert {"defenses.0.name", "defenses.0.params.noise_multiplier", "defenses.0.params.max_norm"} <= names

    def rerun(sub: Path, changed: dict, dev=device, where=rel) -> bool:
        """The run as configured into ``sub``, then ``changed``: whether it reran under a new key."""
        _, before = _runs(monkeypatch, sub, [(job, cand, str(sub / rel), device)])
        ran, after = _runs(monkeypatch, sub, [(job, changed, str(sub / where), dev)])
        return ran == [job] and len(after) == 1 and after[0] != before[0]

    out = tmp_path / "same"
    ran, cells = _runs(monkeypatch, out, [(job, cand, str(out / rel), device)])
    again, cells2 = _runs(monkeypatch, out, [(job, copy.deepcopy(cand), str(out / rel), device)])
    assert ran == [job] and again == [] and cells2 == cells  # the same config: reused under the same key
    missed = []
    for path, value in fields:
        changed = _set(cand, path, _changed(value))
        assert changed != cand, path
        if not rerun(tmp_path / "leaf" / ".".join(map(str, path)), changed):
            missed.append(".".join(map(str, path)))
    assert not missed, f"fields that do not change the run's key (a rerun would reuse the old run): {missed}"
    assert rerun(tmp_path / "device", cand, dev="cuda")  # the device and the run's folder are in the key too
    assert rerun(tmp_path / "folder", cand, where=rel / "variant9")


def test_the_audit_section_changes_the_runs_it_enters(monkeypatch, tmp_path):
    """``audit.seeds`` and ``audit.params.<attack>.<p>`` enter the runs' configs (new keys); ``audit.dp_check``
    enters the DP check's job only; the fields of :data:`NOT_IN_RUN_KEY` enter no run (their reason says why)."""
    raw = _raw("configs/audit/text_dp_gaussian.yaml")

    def keys(sets):
        return {job: mod.run_key(cand, dev, Path(d).relative_to(tmp_path / "plan").as_posix())
                for job, cand, d, dev in _jobs(monkeypatch, tmp_path, raw, sets)}

    base = keys([])
    assert "dp_check" in base and "utr@0#0" in base
    assert keys(["audit.params.utr.rank_rtol=1e-4"])["utr@0#0"] != base["utr@0#0"]
    seeds = keys(["audit.seeds=[0,1]"])
    assert "utr@1#0" in seeds and seeds["utr@1#0"] != seeds["utr@0#0"]
    dp = keys(["audit.dp_check={canaries: 50}"])
    assert dp["dp_check"] != base["dp_check"]
    assert {j: k for j, k in dp.items() if j != "dp_check"} == {j: k for j, k in base.items() if j != "dp_check"}
    for field, why in NOT_IN_RUN_KEY.items():
        if field == "audit.dp_check":
            continue
        value = {"audit.advise": "true", "audit.budget": "60", "audit.utility_rounds": "3"}[field]
        assert keys([f"{field}={value}"]) == base, (field, why)


@pytest.mark.parametrize("change", [
    "defenses=[{name: gaussian_noise, params: {std: 0.01}}]",
    "defenses=[{name: clipping, params: {max_norm: 1.0}}]",
    "defense={name: dpsgd, noise_multiplier: 1.0, max_grad_norm: 1.0}",
    "seed=1", "data.seed=3", "fl.lr=0.01", "peft.reduction_factor=4", "threat.knows_labels=true",
    "audit.params.utr.eps_bag=0.01",
])
def test_a_rerun_with_a_changed_field_reruns_instead_of_reusing(change, monkeypatch, tmp_path):
    """``gradleak audit`` into the same ``--out`` twice, the second time with one field changed (a defense added
    first: a rerun that reused the undefended results would report an undefended audit as the defended one): the
    run reruns with the changed config, and the ledger holds only the new run."""
    calls = []

    def fake_run(cand, out, device=None):
        calls.append(json.dumps(cand, sort_keys=True))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text("{}")
        return {"metrics": {"rouge1_f1": 0.0, "rouge1_f1_null_p99": 23.9}, "artifacts": [], "details": {}}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    raw = _raw("configs/audit/text_adapters.yaml")
    raw["audit"]["dp_check"] = False  # a DP defense's replay of the mechanism is not what this test is about
    try:
        _jobs(monkeypatch, tmp_path, raw, [change])
    except Exception as err:  # noqa: BLE001 -- a change the gate refuses is a broken test, said so
        raise AssertionError(f"--set {change} does not plan: {err}") from err
    mod.run_audit(copy.deepcopy(raw), tmp_path / "out", [], only=["utr"], log=_quiet)
    first = list(calls)
    assert first
    logs: list[str] = []
    mod.run_audit(copy.deepcopy(raw), tmp_path / "out", [change], only=["utr"], log=logs.append)
    rerun = calls[len(first):]
    assert rerun and not any("reused" in m for m in logs), logs
    assert all(c not in first for c in rerun)  # each rerun has the changed config
    ledger = [json.loads(x) for x in (tmp_path / "out" / mod.RUN_LEDGER).read_text().splitlines() if x.strip()]
    assert len(ledger) == len(rerun)


def test_a_code_change_changes_every_resume_key(monkeypatch):
    """Runs measured by other code are never reused: the package's digest is in the attack runs' key and in the
    advice's probe ledger name (a rerun into the same --out after an edit measures again)."""
    import gradleak
    from gradleak.run.audit import run_key

    cand = {"attack": {"name": "utr"}, "seed": 0}
    before = run_key(cand, None, "attacks/utr")
    assert run_key(cand, None, "attacks/utr") == before  # stable within one code
    monkeypatch.setattr(gradleak, "_DIGEST", ["another-code-digest0"])
    assert run_key(cand, None, "attacks/utr") != before
    assert len(gradleak.code_digest()) == 20
