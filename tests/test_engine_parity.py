"""One config through every registered round engine (builtin, Flower, NVFlare): the same uploads and the same audit
verdict (parity of the engines). The engines come from the registry (``ENGINES``), so an engine added later is checked
here without editing this file."""

import copy

import pytest
import torch

from gradleak.fl import Client
from gradleak.fl.engines import ENGINES, engine_of

ENGINE_NAMES = ENGINES.names()
LR = 0.1


def _federation(seed=0, n_clients=3):
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(5 + i, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (5 + i,), generator=g))
            for i in range(n_clients)]
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).double(), [Client(i, x, y) for i, (x, y) in enumerate(data)]


def _fl(engine: str):
    from gradleak.config.schema import FLConfig

    return FLConfig(engine=engine, algorithm="fedavg", lr=LR, rounds=2)


def test_every_engine_is_registered_with_its_section():
    assert {"builtin", "flower", "nvflare"} <= set(ENGINE_NAMES)
    from gradleak.config.schema import FLConfig

    fl = FLConfig()
    for name in ENGINE_NAMES:  # an engine with a section gets it mounted as fl.<name>, with its defaults
        if engine_of(name).section is not None:
            assert isinstance(getattr(fl, name), engine_of(name).section)


#: the update defenses of the parity runs: none (the uploads as trained: a wrong scale shows), noise alone, and
#: clipping + noise (max_norm 0.5 is below every upload's norm here, so clipping alone would hide a wrong scale --
#: a FedAvg update formed from the model after training, twice the upload, clips to the same vector)
DEFENSE_SETS = {"unclipped": [], "noise": [{"name": "gaussian_noise", "params": {"std": 0.01}}],
                "clipped": [{"name": "clipping", "params": {"max_norm": 0.5}},
                            {"name": "gaussian_noise", "params": {"std": 0.01}}]}


def _replies(name: str) -> list:
    """Every reply form an engine's section offers (Flower: weights | update, NVFlare: FULL | DIFF); [None] for an
    engine without one."""
    import typing

    section = engine_of(name).section
    field = (getattr(section, "model_fields", None) or {}).get("reply")
    return list(typing.get_args(field.annotation)) if field is not None else [None]


@pytest.mark.parametrize("defenses", list(DEFENSE_SETS))
@pytest.mark.parametrize("algorithm", ["fedsgd", "fedavg"])
def test_every_engine_gives_the_builtin_uploads(algorithm, defenses):
    """The same federation, defenses and seeds through each engine's round function (as the pipeline gets it from
    the registry), in each of its reply forms: every upload and every model sent equal the builtin engine's to 1e-12
    in float64 -- unclipped too, where a wrong scale of the upload (FedAvg's weight change read from the model after
    training: twice the upload) cannot hide under the clipping bound."""
    from gradleak.defenses import build_defenses

    def kw():
        return dict(rounds=2, algorithm=algorithm, lr=LR, local_epochs=2, local_batch_size=3, seed=5,
                    defenses=build_defenses(copy.deepcopy(DEFENSE_SETS[defenses]), seed=5))

    ref_model, ref_clients = _federation()
    ref = engine_of("builtin").rounds(_fl("builtin"))(ref_model, ref_clients, **kw())
    norms = [float(torch.sqrt(sum((v.double() ** 2).sum() for v in u.tensors.values()))) for r in ref.rounds for u in r]
    if defenses == "unclipped":  # above the clipping bound of the clipped set: there, clipping sets every norm
        assert min(norms) > 0.5, norms
    for name in ENGINE_NAMES:
        for reply in _replies(name):
            fl = _fl(name)
            if reply is not None:
                setattr(getattr(fl, name), "reply", reply)
            model, clients = _federation()
            got = engine_of(name).rounds(fl)(model, clients, **kw())
            assert got.kept_rounds == ref.kept_rounds, (name, reply)
            for ra, rb in zip(ref.rounds, got.rounds):
                assert [u.client_id for u in rb] == [u.client_id for u in ra], (name, reply)
                for ua, ub in zip(ra, rb):
                    assert ub.num_samples == ua.num_samples, (name, reply)
                    assert set(ub.tensors) == set(ua.tensors), (name, reply)
                    for k in ua.tensors:
                        assert torch.allclose(ub.tensors[k].double(), ua.tensors[k].double(), rtol=0, atol=1e-12), \
                            (name, reply, k)
            for sa, sb in zip(ref.round_states, got.round_states):
                for k in sa:
                    assert torch.allclose(sa[k].double(), sb[k].double(), rtol=0, atol=1e-12), (name, reply, k)
            assert all(torch.allclose(p.double(), q.double(), rtol=0, atol=1e-12)  # the final model too
                       for p, q in zip(ref.model.parameters(), got.model.parameters())), (name, reply)


def test_one_config_gives_the_same_verdict_on_every_engine(tmp_path):
    """``gradleak audit configs/audit/text_adapters.yaml --only utr`` with ``fl.engine`` set to each engine: the same
    verdict, the same level and the same headline value (MiniLM + adapters, real sentences, UTR exact)."""
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import run_audit

    raw = load_yaml("configs/audit/text_adapters.yaml")
    got = {}
    for name in ENGINE_NAMES:
        res = run_audit(copy.deepcopy(raw), tmp_path / name, [f"fl.engine={name}"], only=["utr"], log=lambda m: None)
        utr = next(a for a in res["attacks"] if a["name"] == "utr")
        got[name] = (res["verdict"], utr["level"], utr["value"], utr.get("n_success"), utr.get("n_total"))
    assert got["builtin"][1] == "exact"
    assert all(v == got["builtin"] for v in got.values()), got
