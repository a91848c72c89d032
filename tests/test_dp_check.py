"""The DP check (one-shot empirical ε beside the accountant's ε; gradleak.run.dp_check): the estimator against the
Gaussian mechanism's exact ε, correct mechanisms called consistent, and each plausible DP bug called violated."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from gradleak.evaluation.empirical_epsilon import (delta_two_gaussians, dp_verdict, epsilon_two_gaussians, estimate,
                                                   gaussian_mechanism_epsilon, threshold_lower_bound)

TINY = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious"},
        "attack": {"name": "inverting_gradients", "steps": 1, "labels": "idlg"}, "fl": {"clients": 2}}


def _cfg(**over):
    from gradleak.run import validate

    raw = copy.deepcopy(TINY)
    for k, v in over.items():
        raw[k] = v
    return validate(raw, [])[1]


def _check(cfg, canaries=100):
    from gradleak.run.dp_check import dp_check

    return dp_check(cfg, "cpu", canaries=canaries)


# ------------------------------------------------------------------------------------------------ the estimator
@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_two_gaussians_equal_spread_is_the_analytic_gaussian_mechanism(mu, delta):
    """δ(ε) of N(0,1) vs N(μ,1) is Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang 2018, Thm. 8): the ε found
    gives back δ, and the affine invariance holds."""
    from scipy.stats import norm

    eps = gaussian_mechanism_epsilon(mu, delta)
    want = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    assert want == pytest.approx(delta, rel=1e-3)
    assert epsilon_two_gaussians(3.0, 2.0, 3.0 + 2.0 * mu, 2.0, delta) == pytest.approx(eps, rel=1e-5)


def test_unequal_spreads_give_the_delta_asked_for():
    """The separate-spread pair: the ε found has δ(ε) = δ in the worse direction (checked by Monte Carlo)."""
    rng = np.random.default_rng(0)
    for mu0, s0, mu1, s1 in [(0.0, 1.0, 1.0, 1.3), (0.2, 0.7, 1.5, 0.5)]:
        eps = epsilon_two_gaussians(mu0, s0, mu1, s1, 1e-2)
        assert delta_two_gaussians(mu0, s0, mu1, s1, eps) == pytest.approx(1e-2, rel=1e-3)
        worst = 0.0
        for (a, sa), (b, sb) in [((mu0, s0), (mu1, s1)), ((mu1, s1), (mu0, s0))]:
            y = rng.normal(a, sa, 400_000)
            loss = (-(y - a) ** 2 / (2 * sa ** 2) - math.log(sa)) - (-(y - b) ** 2 / (2 * sb ** 2) - math.log(sb))
            worst = max(worst, float(np.mean(np.maximum(0, 1 - np.exp(eps - loss)))))
        assert worst == pytest.approx(1e-2, rel=0.05)


def test_the_estimate_recovers_the_gaussian_mechanisms_epsilon_on_a_synthetic_release():
    """A synthetic Gaussian mechanism in d = 20,000 (sum of 200 unit canaries clipped to 1, plus N(0, σ²) per
    coordinate, σ = 1): the cosine statistics' estimate has the analytic ε (one round: μ = 1/σ) inside its interval,
    and the threshold bound is below it."""
    g = torch.Generator().manual_seed(0)
    d, k, sigma = 20_000, 200, 1.0
    seen = torch.randn(k, d, generator=g, dtype=torch.float64)
    seen /= seen.norm(dim=1, keepdim=True)
    unseen = torch.randn(k, d, generator=g, dtype=torch.float64)
    unseen /= unseen.norm(dim=1, keepdim=True)
    release = [c + sigma * torch.randn(d, generator=g, dtype=torch.float64) for c in seen]  # each canary's own upload
    s = [float(c @ r / r.norm()) for c, r in zip(seen, release)]
    u = [float(c @ r / r.norm()) for c, r in zip(unseen, release)]
    est = estimate(s, u, 1e-5)
    exact = gaussian_mechanism_epsilon(1.0 / sigma, 1e-5)
    assert est["interval"][0] <= exact <= est["interval"][1]
    assert est["strict_lower"] <= exact
    assert est["lower_bound"] <= exact


def test_the_threshold_bound_grows_with_separation_and_stays_below_log_k():
    rng = np.random.default_rng(1)
    u = rng.normal(0, 1, 100)
    weak = threshold_lower_bound(rng.normal(0.5, 1, 100), u, 1e-5)
    strong = threshold_lower_bound(rng.normal(20, 1, 100), u, 1e-5)
    assert 0 <= weak < strong <= math.log(2 * 100 / 0.05)


def test_the_verdict_rules():
    m = {"threat_model": "each_upload", "epsilon": 9.0, "interval": [8.0, 10.0], "strict_lower": 7.5}
    assert dp_verdict(5.0, [m])[0] == "claim_violated"
    assert dp_verdict(8.0, [m])[0] == "consistent"  # the point estimate above, the 99.9 % lower end not
    assert dp_verdict(12.0, [m])[0] == "vacuous"
    assert dp_verdict(math.inf, [m])[0] == "vacuous"
    assert dp_verdict(50.0, [{**m, "strict_lower": 60.0}])[0] == "claim_violated"  # a vacuous claim still violated
    # an infinite estimate means "beyond the search's cap": it violates a claim below the cap (no noise at all), not
    # a larger one (DP-Gaussian at z = 0.001 claims 5.5e5 for one round; its canaries separate beyond the cap)
    beyond = {**m, "epsilon": math.inf, "interval": [math.inf, math.inf], "strict_lower": math.inf}
    assert dp_verdict(5.0, [beyond])[0] == "claim_violated"
    assert dp_verdict(5.5e5, [beyond])[0] == "vacuous"


# ------------------------------------------------------------------------------------ correct mechanisms: consistent
@pytest.mark.parametrize("where", ["client", "server"])
def test_dp_gaussian_is_consistent_and_the_estimate_brackets_its_exact_epsilon(where):
    from gradleak.accounting import gaussian_rdp_epsilon

    cfg = _cfg(defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3, "where": where}}])
    res = _check(cfg)
    assert res["verdict"] == "consistent", res["sentence"]
    assert res["claimed_epsilon"] == pytest.approx(gaussian_rdp_epsilon(1.0, 1, 1e-5))
    models = {m["threat_model"]: m for m in res["measured"]}
    assert ("each_upload" in models) == (where == "client")  # central DP claims nothing against the server
    decisive = models["each_upload" if where == "client" else "final_model"]
    exact = gaussian_mechanism_epsilon(1.0, 1e-5)
    assert decisive["interval"][0] <= exact <= decisive["interval"][1]


def test_dpsgd_is_consistent_and_claims_its_accountants_epsilon():
    pytest.importorskip("opacus")
    cfg = _cfg(defense={"name": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0})
    res = _check(cfg)
    assert res["verdict"] == "consistent", res["sentence"]
    (mech,) = res["mechanisms"]
    assert mech["name"] == "dpsgd" and "Opacus" in mech["accountant"]
    each = next(m for m in res["measured"] if m["threat_model"] == "each_upload")
    assert each["interval"][0] <= gaussian_mechanism_epsilon(1.0, 1e-5) <= each["interval"][1]


def test_no_dp_declared_means_no_check():
    assert _check(_cfg(defenses=[{"name": "gaussian_noise", "params": {"std": 0.1}}])) is None


def test_a_hollow_claim_is_vacuous():
    res = _check(_cfg(defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 0.05, "max_norm": 1e-3}}]))
    assert res["verdict"] == "vacuous" and res["claimed_epsilon"] > 10


# ------------------------------------------------------------------------------------ broken mechanisms: violated
def _noise_before_clipping(self, update, ctx):
    return self.clip.apply(self.noise.apply(update, ctx), ctx)


def _clipping_ignored(self, update, ctx):
    return self.noise.apply(update, ctx)


def _no_noise(self, update, ctx):
    return self.clip.apply(update, ctx)


@pytest.mark.parametrize("broken", [_noise_before_clipping, _clipping_ignored, _no_noise],
                         ids=["noise-before-clipping", "clipping-ignored", "no-noise"])
def test_a_broken_local_dp_gaussian_violates_its_claim(broken, monkeypatch):
    from gradleak.defenses.update import DPGaussian

    monkeypatch.setattr(DPGaussian, "apply", broken)
    res = _check(_cfg(defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3}}]))
    assert res["verdict"] == "claim_violated", res["sentence"]


def test_noise_skipped_on_one_upload_in_ten_violates_the_claim(monkeypatch):
    """Every tenth client upload clipped but not noised (canaries included): each upload's statistics are a
    mixture, whose one-spread fit *lowers* ε below the claim; the claim tests (spread, tail) call it violated."""
    from gradleak.defenses.update import DPGaussian

    real = DPGaussian.apply

    def skip_one_in_ten(self, update, ctx):
        return self.clip.apply(update, ctx) if ctx["client_id"] % 10 == 0 else real(self, update, ctx)

    monkeypatch.setattr(DPGaussian, "apply", skip_one_in_ten)
    res = _check(_cfg(defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3}}]))
    assert res["verdict"] == "claim_violated", res["sentence"]
    each = next(m for m in res["measured"] if m["threat_model"] == "each_upload")
    assert each["strict_lower"] < res["claimed_epsilon"]  # the fit alone would have read it consistent
    assert each["tests"]["tail"]["statistic"] == 10 and each["tests"]["tail"]["rejects"]
    assert each["tests"]["spread"]["rejects"]
    assert "uploads that escaped the noise" in res["sentence"]


def test_one_tensor_left_unnoised_violates_the_claim(monkeypatch):
    """The noise loop misses the upload's largest tensor (every other tensor noised right, every upload clipped): an
    isotropic canary's cosine barely moves, but that tensor's noise energy across the canary is the float rounding of
    the clipped upload, far below the other tensors' per coordinate: the per-tensor tests call it violated, in each
    upload and in the aggregate."""
    from gradleak.defenses.update import DPGaussian

    real = DPGaussian.apply

    def one_tensor_unnoised(self, update, ctx):
        clipped = self.clip.apply(update, ctx)
        name = max(clipped.tensors, key=lambda k: clipped.tensors[k].numel())
        return real(self, update, ctx).map(lambda k, v: clipped.tensors[k] if k == name else v)

    monkeypatch.setattr(DPGaussian, "apply", one_tensor_unnoised)
    res = _check(_cfg(defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3}}]))
    assert res["verdict"] == "claim_violated", res["sentence"]
    for m in res["measured"]:
        assert m["tests"]["tensor_variance"]["rejects"], m["threat_model"]
    each = next(m for m in res["measured"] if m["threat_model"] == "each_upload")
    assert each["tests"]["tensor_tail"]["rejects"] and each["tests"]["tensor_variance"]["statistic"] < 1e-6
    assert "a tensor the noise misses" in res["sentence"]


def test_the_correct_mechanism_passes_every_claim_test():
    res = _check(_cfg(defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3}}]))
    assert res["verdict"] == "consistent" and res["tests_alpha"] == 0.01
    for m in res["measured"]:
        # one round: the final model is one released vector (no per-tensor tail over vectors); each upload has both
        tensor = {"tensor_variance", "tensor_tail"} if m["threat_model"] == "each_upload" else {"tensor_variance"}
        assert set(m["tests"]) == {"shift", "spread", "tail"} | tensor
        assert not any(t["rejects"] for t in m["tests"].values())
        # 3 + 1 tests of the final model (= every round), 3 + 2 of each upload
        assert m["tests"]["tail"]["alpha"] == pytest.approx(0.01 / 9)
        assert m["tests"]["tensor_variance"]["tensors_tested"] >= 2


def test_central_noise_divided_by_the_client_count_twice_violates_the_claim(monkeypatch):
    from gradleak.defenses.update import DPGaussian, GaussianNoise

    def twice(self, aggregate, ctx, num_updates):
        k = max(num_updates, 1)
        return GaussianNoise(self.noise_multiplier * self.max_norm / k / k, seed=self.noise.seed).apply(
            aggregate, {**ctx, "client_id": -1})

    monkeypatch.setattr(DPGaussian, "server_apply", twice)
    res = _check(_cfg(defenses=[{"name": "dp_gaussian",
                                 "params": {"noise_multiplier": 1.0, "max_norm": 1e-3, "where": "server"}}]))
    assert res["verdict"] == "claim_violated", res["sentence"]


@pytest.mark.parametrize("breakage", ["no-noise", "clipping-ignored"])
def test_a_broken_dpsgd_violates_its_claim(breakage, monkeypatch):
    pytest.importorskip("opacus")
    from gradleak.defenses.training import DPSGD

    real = DPSGD.privatise

    def broken(self, per, gen):
        c = self.cfg
        if breakage == "no-noise":
            saved = c.noise_multiplier
            object.__setattr__(c, "noise_multiplier", 0.0)
            try:
                return real(self, per, gen)
            finally:
                object.__setattr__(c, "noise_multiplier", saved)
        b = per[0].shape[0]
        return [(g.sum(0) + torch.randn(g.shape[1], generator=gen, dtype=torch.float64) * c.noise_multiplier
                 * c.max_grad_norm) / b for g in per]

    monkeypatch.setattr(DPSGD, "privatise", broken)
    res = _check(_cfg(defense={"name": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}))
    assert res["verdict"] == "claim_violated", res["sentence"]


# ------------------------------------------------------------------------------------------------ the accountant
@pytest.mark.parametrize("z, steps", [(1.0, 1), (0.3, 5), (5.0, 200), (2.0, 3)])
def test_the_closed_form_gaussian_accountant_is_opacus_rdp(z, steps):
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    from gradleak.accounting import gaussian_rdp_epsilon

    acc = RDPAccountant()
    acc.history = [(z, 1.0, steps)]
    assert gaussian_rdp_epsilon(z, steps, 1e-5) == pytest.approx(float(acc.get_epsilon(1e-5)), rel=1e-12)


def test_flowers_central_dp_wrapper_is_checked_on_the_flower_engine():
    """fl.engine: flower with DifferentialPrivacyServerSideFixedClipping: the canaries go through Flower's own
    strategy wrapper (clipping norm on Δw), and its claim (RDP of its noise multiplier) holds."""
    pytest.importorskip("flwr")
    cfg = _cfg(fl={"clients": 2, "engine": "flower",
                   "flower": {"dp": "server-fixed", "noise_multiplier": 1.0, "clipping_norm": 1e-5}})
    res = _check(cfg, canaries=60)
    assert res["engine"] == "flower" and res["mechanisms"][0]["name"] == "flower server-fixed"
    assert res["verdict"] == "consistent", res["sentence"]
    assert {m["threat_model"] for m in res["measured"]} == {"final_model", "every_round"}


# ------------------------------------------------------------------------------------------------ in the audit
AUDIT = {**{k: v for k, v in TINY.items() if k != "attack"}, "audit": {"params": {"dlg": {"steps": 1}}},
         "defenses": [{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3}}]}


def test_the_audit_writes_dp_check_and_the_report_says_it(tmp_path):
    """audit.json gets dp_check (claimed ε named, measured ε per threat model with its interval, the verdict), the
    report a section in words; a rerun into the same --out reuses the check (a job of the audit's resumable ledger)."""
    from gradleak.run.audit import run_audit

    logs = []
    res = run_audit(copy.deepcopy(AUDIT), tmp_path, only=["dlg"], log=logs.append)
    dp = res["dp_check"]
    assert dp["verdict"] == "consistent" and dp["claimed_epsilon"] == pytest.approx(4.7285, rel=1e-4)
    assert "RDP of the Gaussian mechanism" in dp["mechanisms"][0]["accountant"]
    assert {m["threat_model"] for m in dp["measured"]} == {"final_model", "every_round", "each_upload"}
    assert all(m["interval"][0] <= m["epsilon"] <= m["interval"][1] for m in dp["measured"])
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert saved["dp_check"]["verdict"] == "consistent"
    page = (tmp_path / "report.html").read_text()
    assert 'id="dp_check"' in page and "CONSISTENT" in page and "claimed by dp_gaussian" in page
    assert any("dp_check: CONSISTENT" in m for m in logs)
    logs.clear()
    again = run_audit(copy.deepcopy(AUDIT), tmp_path, only=["dlg"], log=logs.append)
    assert again["dp_check"] == dp  # reused from the audit's ledger (attacks/runs.jsonl), not rerun
    assert any("reused" in m and "dp_check" in m for m in logs), logs


def test_dp_check_false_skips_it_and_a_bad_value_names_the_field(tmp_path):
    from gradleak.errors import BadInput
    from gradleak.run.audit import audit_overrides, run_audit

    res = run_audit(copy.deepcopy(AUDIT), tmp_path / "off", ["audit.dp_check=false"], only=["dlg"], log=lambda m: None)
    assert "dp_check" not in res
    with pytest.raises(BadInput) as err:
        audit_overrides(copy.deepcopy(AUDIT), ["audit.dp_check={canaries: 3}"])
    assert err.value.field == "audit.dp_check.canaries"
    with pytest.raises(BadInput) as err:
        audit_overrides(copy.deepcopy(AUDIT), ["audit.dp_check=sometimes"])
    assert err.value.field == "audit.dp_check"


def test_a_crashed_check_is_undefined_never_consistent(tmp_path, monkeypatch):
    from gradleak.run.audit import run_audit

    def boom(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr("gradleak.run.dp_check.dp_check", boom)  # the audit runs it in this process (workers=1)
    res = run_audit(copy.deepcopy(AUDIT), tmp_path, only=["dlg"], log=lambda m: None)
    assert res["dp_check"]["verdict"] == "undefined" and "out of memory" in res["dp_check"]["sentence"]


def test_the_shipped_dp_config_declares_a_checked_mechanism():
    from gradleak.config.loading import load_yaml
    from gradleak.defenses import build_defenses
    from gradleak.run.audit import plan_audit
    from gradleak.run.dp_check import declared_mechanisms

    raw, _, _, planned, _, _ = plan_audit(load_yaml("configs/audit/text_dp_gaussian.yaml"), [], ["utr"])
    assert raw["audit"]["dp_check"] == {"canaries": 100}
    cfg = planned[0][2]
    mech = declared_mechanisms(cfg, build_defenses([d.model_dump() for d in cfg.defenses], seed=cfg.seed))
    assert [m["name"] for m in mech] == ["dp_gaussian"]
    assert mech[0]["covers"] == ["final_model", "every_round", "each_upload"]


def test_the_canaries_are_fitted_to_the_memory_the_uploads_need():
    from gradleak.run.dp_check import MIN_CANARIES, fitted_canaries

    assert fitted_canaries(100, 445_636, 1, 1) == 100  # the text audit: about 0.5 GiB
    assert fitted_canaries(100, 2_363_146, 1, 1) == 100  # vit_lora: about 2.6 GiB
    few = fitted_canaries(100, 2_363_146, 5, 8)
    assert MIN_CANARIES <= few < 100 and 5 * (8 + few) * 2_363_146 * 8 + few * 2_363_146 * 4 <= 6 * 2 ** 30
    assert fitted_canaries(100, 50_000_000, 10, 8) == MIN_CANARIES


def test_the_builtin_engine_streams_the_check_round_by_round_and_keeps_no_round(monkeypatch):
    """Over several rounds the builtin engine hands each round to the check as it ends (on_round) and keeps none
    (memory independent of the rounds); the check reads the same statistics as from an engine that returns every
    round (the Flower / NVFlare path)."""
    import gradleak.run.dp_check as mod
    from gradleak.fl.engines.builtin import run_rounds

    cfg = _cfg(fl={"clients": 2, "rounds": 3},
               defenses=[{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1e-3}}])
    kept: list = []

    def streaming(model, clients, *, on_round=None, **kw):
        out = run_rounds(model, clients, on_round=on_round, **kw)
        kept.append((len(out.rounds), len(out.round_states), on_round is not None))
        return out

    def returning(model, clients, *, rounds, algorithm, lr, local_epochs=1, local_batch_size=None, defenses=(),
                  seed=0, secure_aggregation=False, local_update=None, client_settings=None, lr_at=None):
        return run_rounds(model, clients, rounds=rounds, algorithm=algorithm, lr=lr, local_epochs=local_epochs,
                          local_batch_size=local_batch_size, defenses=defenses, seed=seed,
                          secure_aggregation=secure_aggregation, local_update=local_update,
                          client_settings=client_settings, lr_at=lr_at)

    import gradleak.fl.engines as engines

    monkeypatch.setattr(engines, "rounds_engine", lambda fl: streaming)
    a = _check(cfg, canaries=40)
    assert kept == [(0, 0, True)]  # every round measured as it ended, none kept
    monkeypatch.setattr(engines, "rounds_engine", lambda fl: returning)
    b = _check(cfg, canaries=40)
    assert a["verdict"] == b["verdict"]
    ea = {m["threat_model"]: m.get("epsilon") for m in a["measured"]}
    eb = {m["threat_model"]: m.get("epsilon") for m in b["measured"]}
    assert ea.keys() == eb.keys() and all(abs((ea[k] or 0) - (eb[k] or 0)) < 1e-9 for k in ea), (ea, eb)
