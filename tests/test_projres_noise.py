"""Noise-aware ProjRes (``attack.noise``): the signal-subspace residual and the chi-square matched filter on a noisy
upload, and the audit's variants under declared noise (src/gradleak/attacks/projres.py, "Noisy uploads").

Synthetic, seeded, CPU: a toy encoder (frozen token embeddings -> one trainable linear layer) whose upload is the
members' low-rank gradient plus i.i.d. Gaussian noise, scored through ``ProjRes.reconstruct`` on a hand-built view."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradleak.attacks.projres import NoisyRowSpace, ProjRes, noisy_row_space, relative_residual, row_space
from gradleak.evaluation.nulls import roc_summary
from gradleak.fl.core import ServerView, Update

VOCAB, WIDTH = 400, 64


class _Tok:
    """Texts are space-separated token ids; [CLS] = 1, [SEP] = 2, padding 0."""

    all_special_ids = [0, 1, 2]
    pad_token_id = 0

    def encode(self, text, add_special_tokens=True):
        ids = [int(w) for w in text.split()]
        return [1] + ids + [2] if add_special_tokens else ids


class _Toy(nn.Module):
    def __init__(self, out: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(VOCAB, WIDTH, generator=g))
        self.emb.weight.requires_grad_(False)
        self.head = nn.Linear(WIDTH, out, bias=False)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.emb(input_ids))


def _case(seed: int, sigma: float, out: int = 96, members: int = 4, nonmembers: int = 40, length: int = 3,
          signal: float = 1.0):
    """A view of one client whose upload is the head's gradient on ``members`` sentences (``length`` distinct tokens
    each, back-propagated errors N(0, signal^2)) plus N(0, sigma^2) noise; candidates: members + non-members (tokens
    disjoint from the members'), shuffled. Returns (view, membership)."""
    g = torch.Generator().manual_seed(seed)
    model = _Toy(out, seed)
    perm = (torch.randperm(VOCAB - 3, generator=g) + 3).tolist()
    mem = [perm[i * length:(i + 1) * length] for i in range(members)]
    rest = perm[members * length:]
    non = [[rest[int(j)] for j in torch.randint(len(rest), (length,), generator=g)] for _ in range(nonmembers)]
    H = model.emb.weight.detach().to(torch.float64)[torch.tensor([t for s in mem for t in s])]
    D = signal * torch.randn(out, H.shape[0], generator=g, dtype=torch.float64)
    G = D @ H + sigma * torch.randn(out, WIDTH, generator=g, dtype=torch.float64)
    texts = [(" ".join(map(str, s)), True) for s in mem] + [(" ".join(map(str, s)), False) for s in non]
    order = torch.randperm(len(texts), generator=g).tolist()
    texts = [texts[i] for i in order]
    upd = Update({"head.weight": G.float()}, members)
    state = {"head.weight": model.head.weight.detach().clone()}
    public = {"tokenizer": _Tok(), "model_kind": "encoder", "candidates": {0: [t for t, _ in texts]},
              "update_defenses": [{"name": "gaussian_noise", "params": {"std": sigma}}] if sigma else []}
    view = ServerView(model, [upd], public=public, rounds=[[upd]], round_states=[state])
    return view, [int(m) for _, m in texts]


def _auc(view, labels, **params) -> tuple[float, dict]:
    rec = ProjRes(**params).reconstruct(view)
    return roc_summary(labels, rec.data["scores"][0])["auc"], rec.info


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_mode_separates_members_where_the_plain_row_space_is_everything(seed):
    """out 96 >= in 64: the noisy gradient is full rank, every plain residual is 0 (AUC 1/2); the signal subspace
    above the noise edge and the matched filter both rank the members first."""
    view, labels = _case(seed, sigma=0.5)
    auc, info = _auc(view, labels)
    assert auc == 0.5 and info["rank_per_layer"]["head"] == WIDTH
    for score in ("residual", "chi2"):
        auc, info = _auc(view, labels, noise="public", noise_score=score)
        assert auc >= 0.95, (score, auc)
        assert info["noise_std_per_layer"]["head"] == pytest.approx(0.5)
    assert info["layers_above_noise"] == ["head"]
    # the signal subspace holds the members' 12 token directions, no noise direction
    _, info = _auc(view, labels, noise="public")
    assert info["rank_per_layer"]["head"] == 12
    # the same from the spectrum (no declared std) and from an explicit one
    assert _auc(view, labels, noise="estimate")[0] >= 0.95
    assert _auc(view, labels, noise=0.5, noise_score="chi2")[0] >= 0.95


@pytest.mark.parametrize("score", ["residual", "chi2"])
def test_pure_noise_gives_chance(score):
    """No member signal at all: no direction above the edge / no test past the gate -- every candidate ties."""
    view, labels = _case(3, sigma=0.5, signal=0.0)
    auc, info = _auc(view, labels, noise="public", noise_score=score)
    assert auc == 0.5
    assert info["rank_per_layer"]["head"] == 0
    if score == "chi2":
        assert info["layers_above_noise"] == []


def test_chi2_counts_for_nothing_in_pure_noise_over_many_draws():
    """The gate's level: over 40 pure-noise layers, few pass (expected 1 % each) and the pooled AUC stays at chance."""
    passed, aucs = 0, []
    for seed in range(40):
        view, labels = _case(100 + seed, sigma=1.0, out=8, signal=0.0, nonmembers=20)
        auc, info = _auc(view, labels, noise="public", noise_score="chi2")
        passed += bool(info["layers_above_noise"])
        aucs.append(auc)
    assert passed <= 3
    assert abs(sum(aucs) / len(aucs) - 0.5) < 0.05


def test_the_matched_filter_ranks_members_below_the_spectral_edge():
    """A wide layer (out 4 << in 1024, two members' directions): at this noise no singular value stands above the
    edge sigma (sqrt(4) + sqrt(1024)), so the signal subspace is empty, but the candidates' own directions still
    carry ||G h|| >> sigma sqrt(4): the chi-square statistic separates them."""
    g = torch.Generator().manual_seed(1)
    n, m, sigma = 1024, 4, 1.0
    Hm = torch.nn.functional.normalize(torch.randn(2, n, generator=g, dtype=torch.float64), dim=1)
    Hn = torch.nn.functional.normalize(torch.randn(200, n, generator=g, dtype=torch.float64), dim=1)
    G = 5.0 * torch.randn(m, 2, generator=g, dtype=torch.float64) @ Hm + sigma * torch.randn(m, n, generator=g,
                                                                                              dtype=torch.float64)
    cands, labels = torch.cat([Hm, Hn]), [1, 1] + [0] * 200
    assert noisy_row_space(G, sigma, "residual").rank == 0
    chi = noisy_row_space(G, sigma, "chi2")
    z = chi.chi2_z(cands)
    assert isinstance(chi, NoisyRowSpace) and float(z[:2].min()) > chi.gate(len(cands), 0.01) > float(z[2:].max())
    assert roc_summary(labels, z.tolist())["auc"] == 1.0
    # pure noise: the statistic is chi-square with m degrees of freedom (mean 0, variance 1 after standardising)
    zn = noisy_row_space(sigma * torch.randn(m, n, generator=g, dtype=torch.float64), sigma, "chi2").chi2_z(Hn)
    assert abs(float(zn.mean())) < 0.3 and 0.6 < float(zn.std()) < 1.4


def test_default_is_the_exact_row_space():
    """noise: none (the default) and noise: public without declared noise score with the plain row space."""
    view, labels = _case(4, sigma=0.0)
    a = ProjRes().reconstruct(view)
    b = ProjRes(noise="public").reconstruct(view)
    assert a.data == b.data and "noise" not in a.info
    V = row_space(view.updates[0].tensors["head.weight"], 1e-5)
    assert V.shape[1] == 12 and float(relative_residual(torch.zeros(1, WIDTH), V)) == 0.0
    with pytest.raises(ValueError):
        ProjRes.Config(noise=-1.0)


# ------------------------------------------------------------------------------------------- the audit's variants

TEXT = "configs/audit/text_adapters.yaml"


def _variants(sets):
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import full_strength_variants, plan_audit

    _, _, _, planned, _, _ = plan_audit(load_yaml(TEXT), sets, ["projres"])
    (_, cand, cfg, A), = planned
    return full_strength_variants(A, cand, cfg)


@pytest.mark.parametrize("sets, mode", [
    (["defenses=[{name: gaussian_noise, params: {std: 0.1}}]"], "public"),
    (["defense.name=dpsgd", "defense.noise_multiplier=1.0e-4"], "public"),
    (["defenses=[{name: dp_gaussian, params: {noise_multiplier: 1.0, max_norm: 1.0}}]"], "public"),
    (["defense.name=percentile_noise", "defense.sigma0=1.0"], "estimate"),
])
def test_the_audit_attacks_declared_noise_with_the_noise_modes(sets, mode):
    vs = _variants(sets)
    assert {"noise": mode, "noise_score": "residual"} in vs and {"noise": mode, "noise_score": "chi2"} in vs


@pytest.mark.parametrize("sets", [[], ["defenses=[{name: topk_pruning, params: {prune_fraction: 0.9}}]"],
                                  ["fl.clients=2", "fl.secure_aggregation=true"]])
def test_no_noise_declared_no_noise_variant(sets):
    assert not any("noise" in v for v in _variants(sets))
