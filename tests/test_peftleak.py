"""PEFTLeak: exact recovery on a tiny real case, the per-token simulator, grouping, the threat boundary."""

import copy
import inspect
import math

import pytest
import torch

from gradleak.attacks.base import ThreatModel
from gradleak.attacks.peftleak.attack import PEFTLeak
from gradleak.attacks.peftleak.recovery import PEFTLeakRecovery, group_by_coefficient
from gradleak.attacks.peftleak.server import PEFTLeakServer
from gradleak.data import load
from gradleak.errors import BadInput
from gradleak.fl.core import Client, ServerView
from gradleak.fl.threat import build_view
from gradleak.metrics.patches import image_to_patches, patch_recovery
from gradleak.models.vit import vit
from gradleak.peft.adapters import AdapterSlot, add_vit_adapters
from gradleak.registry import ATTACKS, load_all


def _tiny(design="improved", B=8, r=16, layers=4, seed=0, **kw):
    """ViT with D = P²C = 192 (patch 8, 16×16 images, 4 patches), real CIFAR images, float64."""
    priv = torch.nn.functional.interpolate(load("cifar-samples").images[:B], size=(16, 16), mode="bilinear",
                                           antialias=True, align_corners=False).clamp(0, 1)
    pub = load("natural-crops", n=400, size=16, seed=7).images
    model = vit("vit-tiny", image_size=16, patch_size=8, layers=layers, num_classes=4, dtype=torch.float64, seed=seed)
    add_vit_adapters(model, r)
    atk = PEFTLeak(public_images=pub, design=design, seed=seed, **kw)
    model = atk.prepare(model, ThreatModel(malicious=True, public_data=True))
    x = priv.double() * 2 - 1
    return atk, model, x


def _run(atk, model, x, labels=None):
    client = Client(0, x, labels if labels is not None else torch.arange(len(x)) % 4)
    rounds, states = [], []
    for k in range(atk.num_rounds):
        st = atk.adapter_state(k)
        model.load_state_dict(st, strict=False)
        rounds.append([client.local_update(model)])
        states.append(st)
    return ServerView(model=model, updates=rounds[-1], rounds=rounds, round_states=states), client


def test_exact_recovery_tiny_vit_float64():
    atk, model, x = _tiny("improved", B=8)
    view, _ = _run(atk, model, x)
    rec = atk.reconstruct(view)
    d = rec.data
    truth = image_to_patches(x, 8)
    m = patch_recovery(truth, d["patches"], d["positions"], d["groups"])
    assert m["recovered_patch_psnr_median"] >= 60  # exact up to float64 rounding, not "close"
    assert m["patch_recovery_rate"] >= 0.9
    assert m["grouping_accuracy"] == 1.0
    assert m["false_positives"] == 0


def test_paper_design_recovers_exact_patches():
    atk, model, x = _tiny("paper", B=8)
    view, _ = _run(atk, model, x)
    d = atk.reconstruct(view).data
    m = patch_recovery(image_to_patches(x, 8), d["patches"], d["positions"], d["groups"])
    assert m["isolated_patch_rate"] >= 0.5
    assert m["recovered_patch_psnr_median"] >= 40


def test_authors_count_is_the_nonzero_bins_and_bounds_the_strict_count():
    """The authors' count (every usable bin with a non-zero bias-gradient difference, recover_adapter.py) is what the
    paper design reports beside our strict count: each strictly recovered patch comes from its own non-empty bin, so
    it bounds the strict count from above; it is counted by hand here from the upload."""
    atk, model, x = _tiny("paper", B=8)
    view, _ = _run(atk, model, x)
    rec = atk.reconstruct(view)
    srv = atk.server
    by_hand = 0
    for k in range(len(view.rounds)):
        upd = view.rounds[k][0]
        for sp in srv.plans[k].slots:
            gb = upd.tensors[f"{sp.slot.prefix}.down.bias"].double()
            dgb = torch.cat([gb[:-1] - gb[1:], gb[-1:]])
            usable = torch.zeros(srv.r, dtype=torch.bool)
            usable[sp.usable_bins] = True
            by_hand += int((usable & (dgb.abs() > 1e-9 * (gb.abs().max() + 1e-300))).sum())
    assert rec.metrics["nonzero_bins"] == by_hand > 0
    m = patch_recovery(image_to_patches(x, 8), rec.data["patches"], rec.data["positions"], rec.data["groups"])
    assert by_hand >= round(m["patch_recovery_rate"] * 8 * 4)


def test_simulator_matches_real_model_per_token():
    """The attacker's per-token simulator reproduces the poisoned model's adapter outputs exactly,
    which is what makes identity attention (no token mixing) and the LayerNorm undo exact."""
    atk, model, x = _tiny("improved", B=4)
    st = atk.adapter_state(0)
    model.load_state_dict(st, strict=False)
    outs = []
    hooks = [model.get_submodule(AdapterSlot(b, k).prefix).register_forward_hook(lambda m, i, o: outs.append(o))
             for b in range(atk.L) for k in ("msa", "mlp")]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    emb = model.vit.embeddings(x)  # tokens incl. class token
    final, sim = atk.simulate_tokens(emb.reshape(-1, atk.D), st)
    for real, s in zip(outs, sim):
        assert torch.allclose(real.reshape(-1, atk.D), s, rtol=0, atol=1e-9)


def test_grouping_by_coefficient_respects_positions():
    g = torch.tensor([1.0, 1.0 + 1e-9, 2.0, 2.0, 1.0])
    pos = torch.tensor([1, 2, 1, 2, 1])  # the last patch repeats position 1 of group "1.0"
    groups = group_by_coefficient(g, pos)
    assert groups[0] != groups[4]  # two patches at one position cannot share an image
    assert groups[2] == groups[3] and groups[2] != groups[0]
    assert len(set(groups.tolist())) == 3


def test_attacks_read_only_the_server_view():
    load_all()
    for entry in ATTACKS:
        params = list(inspect.signature(entry.obj.reconstruct).parameters)
        assert params == ["self", "view"], entry.name
    atk, model, x = _tiny("improved", B=4)
    view, client = _run(atk, model, x)
    expected = image_to_patches(x, 8).clone()
    # destroy every copy of the private batch the client holds: the attack still succeeds from the view
    client._inputs.zero_()
    client._labels.zero_()
    del client
    x.zero_()
    d = atk.reconstruct(view).data
    m = patch_recovery(expected, d["patches"], d["positions"], d["groups"])
    assert m["patch_recovery_rate"] >= 0.9


def test_low_resolution_needed_when_patch_larger_than_width():
    pub = load("natural-crops", n=50, size=16, seed=0).images
    model = vit("vit-tiny", image_size=16, patch_size=16, layers=2, num_classes=4, dtype=torch.float64)
    add_vit_adapters(model, 8)
    with pytest.raises(BadInput) as err:
        PEFTLeak(public_images=pub).prepare(model)
    assert err.value.field == "model.patch_size" and "low_resolution" in str(err.value)


def test_low_resolution_recovers_block_means():
    """ViT-B/32-style: P²C = 4·D; the attack recovers the 2×2 block means exactly."""
    priv = torch.nn.functional.interpolate(load("cifar-samples").images[:4], size=(32, 32)).clamp(0, 1)
    pub = load("natural-crops", n=200, size=32, seed=3).images
    model = vit("vit-tiny", image_size=32, patch_size=16, layers=4, num_classes=4, dtype=torch.float64)
    add_vit_adapters(model, 16)
    atk = PEFTLeak(public_images=pub, low_resolution=True)
    model = atk.prepare(model)
    x = priv.double() * 2 - 1
    view, _ = _run(atk, model, x)
    d = atk.reconstruct(view).data
    m = patch_recovery(image_to_patches(x, 16, reduce=2), d["patches"], d["positions"], d["groups"])
    assert m["recovered_patch_psnr_median"] >= 40 and m["patch_recovery_rate"] >= 0.75


@pytest.mark.parametrize("kwargs,field", [({"sigma": 0}, "attack.sigma"), ({"sigma": -1.0}, "attack.sigma"),
                                          ({"design": "magic"}, "attack.design")])
def test_bad_attack_parameters(kwargs, field):
    with pytest.raises(BadInput) as err:
        PEFTLeak(public_images=torch.zeros(1, 3, 16, 16), **kwargs)
    assert err.value.field == field


def test_bad_bottleneck():
    model = vit("vit-tiny", image_size=16, patch_size=8, layers=1, num_classes=4)
    with pytest.raises(BadInput) as err:
        add_vit_adapters(model, 0)
    assert err.value.field == "model.adapter_bottleneck"


def test_patch_recovery_metric_identities():
    truth = torch.rand(3, 4, 12) * 2 - 1
    patches = truth.reshape(-1, 12)
    positions = torch.arange(1, 5).repeat(3)
    groups = torch.arange(3).repeat_interleave(4)
    m = patch_recovery(truth, patches, positions, groups)
    assert m["patch_recovery_rate"] == 1.0 and m["grouping_accuracy"] == 1.0 and m["false_positives"] == 0
    assert math.isinf(m["recovered_patch_psnr_median"]) or m["recovered_patch_psnr_median"] > 200
    # one image scattered over other groups: its patches no longer count as recovered
    bad = groups.clone()
    bad[8:12] = torch.tensor([0, 1, 0, 1])
    m2 = patch_recovery(truth, patches, positions, bad)
    assert m2["isolated_patch_rate"] == 1.0 and m2["patch_recovery_rate"] < 1.0 and m2["grouping_accuracy"] < 1.0
    # noise beyond the 30 dB threshold: not recovered, counted as false positives
    m3 = patch_recovery(truth, patches + 0.5, positions, groups)
    assert m3["patch_recovery_rate"] == 0.0 and m3["false_positives"] == 12


def test_fedavg_aware_poisoning_survives_local_epochs():
    """FedAvg (App. C.6): with the FedAvg-aware scaling, several local SGD steps still leak exact patches."""
    atk, model, x = _tiny("improved", B=8, fedavg_aware=True)
    client = Client(0, x, torch.arange(len(x)) % 4)
    st = atk.adapter_state(0)
    model.load_state_dict(st, strict=False)
    rounds, states = [], []
    for k in range(atk.num_rounds):
        st = atk.adapter_state(k)
        model.load_state_dict(st, strict=False)
        rounds.append([client.local_update(model, algorithm="fedavg", epochs=3, lr=1e-3)])
        states.append(st)
    assert rounds[0][0].kind == "pseudo_gradient" and rounds[0][0].local_steps == 3
    view = ServerView(model=model, updates=rounds[-1], rounds=rounds, round_states=states)
    d = atk.reconstruct(view).data
    m = patch_recovery(image_to_patches(x, 8), d["patches"], d["positions"], d["groups"])
    assert m["isolated_patch_rate"] >= 0.9 and m["recovered_patch_psnr_median"] >= 40


def _reachable(root):
    """Every object reachable from ``root`` through attributes, dicts, lists, tuples and sets (tensors are leaves)."""
    seen, stack, out = set(), [root], []
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        out.append(o)
        if isinstance(o, (torch.Tensor, torch.nn.Module, type)):
            continue
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif hasattr(o, "__dict__"):
            stack += list(vars(o).values())
    return out


def test_server_and_recovery_are_separate():
    """The server piece poisons and writes the adapters; the recovery piece holds no model and no client
    data, and the protocol (prepare -> server_model(r) -> client update -> view -> reconstruct) recovers
    every patch exactly."""
    atk, model, x = _tiny("improved", B=4)
    assert isinstance(atk.server, PEFTLeakServer) and isinstance(atk.recovery, PEFTLeakRecovery)
    assert atk.recovery.server is atk.server
    assert atk.rounds_wanted(1) == atk.num_rounds == atk.server.num_rounds  # the plan decides, not fl.rounds
    client = Client(0, x, torch.arange(len(x)) % 4)
    private = {x.untyped_storage().data_ptr(), client._inputs.untyped_storage().data_ptr(),
               client._labels.untyped_storage().data_ptr()}

    def check_clean():
        objs = _reachable(atk.recovery)
        assert not any(isinstance(o, torch.nn.Module) for o in objs)
        assert not any(isinstance(o, Client) for o in objs)
        assert not any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in private for o in objs)

    check_clean()
    rounds, states = [], []
    for r in range(atk.rounds_wanted(1)):
        if r:  # like the runner, apply the previous round's update (FedSGD step): the server sends its weights again
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in rounds[-1][0].tensors:
                        p.sub_(1e-3 * rounds[-1][0].tensors[n])
        model = atk.server_model(r, model)
        sent = atk.server.round_state(r)  # the round's malicious adapters and the poisoned head
        assert any(n.startswith("head.") for n in sent)
        for n, v in sent.items():
            assert torch.equal(model.get_parameter(n).detach(), v)
        rounds.append([client.local_update(copy.deepcopy(model))])
        states.append({n: v.detach().clone() for n, v in model.state_dict().items()})
    view = build_view(model=model, rounds=rounds, round_states=states,
                      threat=ThreatModel(capability="malicious", malicious=True, prescribes_architecture=True, public_data=True),
                      secure_sum=None, knowledge={}, always_public={})
    rec = atk.reconstruct(view)
    check_clean()
    d = rec.data
    truth = image_to_patches(x, 8)
    m = patch_recovery(truth, d["patches"], d["positions"], d["groups"])
    assert m["patch_recovery_rate"] == 1.0 and m["grouping_accuracy"] == 1.0 and m["false_positives"] == 0
    assert m["recovered_patch_psnr_median"] >= 60  # exact up to float64 rounding
    # every true patch is found at its position, exactly but for the one pixel direction the LayerNorm
    # removes (A1.5: filled with its public mean)
    u = atk.lost_dir
    seen = (truth - ((truth @ u) - atk.lost_mean)[..., None] * u).clamp(-1, 1)
    for t in range(1, 5):
        err = (seen[:, t - 1, None] - d["patches"][d["positions"] == t][None]).abs().amax(-1).amin(1)
        assert float(err.max()) < 1e-6, (t, err)
    assert (d["patch_size"], d["channels"], d["num_positions"], d["image_size"], d["reduce"]) == (8, 3, 4, 16, 1)
    assert d["attacked_positions"] == [1, 2, 3, 4]
    assert rec.metrics.pop("nonzero_bins") >= 4 * 4  # 4 images' patches in usable bins at each of the 4 positions
    # the bins' information limit (gradleak.attacks.peftleak.limit): with no noise declared, the signal scale only
    limit = {k: rec.metrics.pop(k) for k in list(rec.metrics) if k.endswith("_adapter_bins")}
    assert set(limit) == {f"{k}_adapter_bins" for k in ("drowning_noise_std_all", "drowning_noise_std_median",
                                                         "drowning_noise_std", "bins_tested")}
    assert limit["drowning_noise_std_all_adapter_bins"] >= limit["drowning_noise_std_adapter_bins"] > 0
    assert rec.metrics == {"attacked_positions": 4, "rounds_used": atk.num_rounds, "adapters_per_position": atk.K,
                           "hash_directions_per_position": atk.K if atk.multi_direction else 1,
                           "positions_per_round": atk.ppr, "rounds_needed_all_positions": atk.num_rounds}


def test_config_and_from_config():
    """The ``attack:`` parameters are checked by pydantic; from_config takes the public images, the batch
    size and the FedAvg default from the context, and refuses a context without public images."""
    import pydantic

    from gradleak.attacks.base import AttackContext

    for bad in ({"sigma": 0}, {"up_scale": 1.0}, {"design": "magic"}, {"max_rounds": 0}, {"adapters_per_position": 0},
                {"unknown": 1}):
        with pytest.raises(pydantic.ValidationError):
            PEFTLeak.Config(**bad)
    assert PEFTLeak.requires() == {"malicious": True, "public_data": True, "individual_updates": True}
    assert ATTACKS.get("peftleak") is PEFTLeak and PEFTLeak.reconstruction == "patches" and PEFTLeak.needs_float64
    pub = load("natural-crops", n=20, size=16, seed=0).images
    threat = ThreatModel(capability="malicious", malicious=True, public_data=True)
    ctx = AttackContext(seed=3, device="cpu", threat=threat, fl={"algorithm": "fedavg"},
                        public={"public_images": pub, "batch_size": 8})
    atk = PEFTLeak.from_config(PEFTLeak.Config(design="paper", max_rounds=2), ctx)
    assert atk.design == "paper" and atk.fedavg_aware and atk.expected_batch_size == 8 and atk.seed == 3
    assert atk.max_rounds == 2 and atk.server.public_images is pub
    atk = PEFTLeak.from_config(PEFTLeak.Config(fedavg_aware=False), AttackContext(seed=0, device="cpu", threat=threat,
                               fl={"algorithm": "fedavg"}, public={"public_images": pub}))
    assert not atk.fedavg_aware and atk.expected_batch_size is None
    with pytest.raises(BadInput) as err:
        PEFTLeak.from_config(PEFTLeak.Config(), AttackContext(seed=0, device="cpu", threat=threat))
    assert err.value.field == "threat.public_data"
    with pytest.raises(BadInput) as err:
        PEFTLeak(public_images=pub).prepare(None, ThreatModel())  # honest server: refused before touching the model
    assert err.value.field == "threat.malicious"
