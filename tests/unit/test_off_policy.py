"""Off-policy corrections of the decoupled objective (trainer.off_policy) against a plain loop
reference: loss, gradient (analytic and finite differences) and stats, in [batch, T] rows and in
packed 1-D form; what happens when everything is dropped; and the config's checks."""

import math
import random

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from areal_core.algo import decoupled_ppo_loss
from areal_core.algo.off_policy import (
    OffPolicyCap,
    OffPolicyGeoMask,
    OffPolicyIcePop,
    OffPolicyM2PO,
    OffPolicyMIS,
    OffPolicyNone,
    OffPolicyTIS,
)
from areal_core.experiment import ConfigError, load_config
from areal_core.trainer.config import TrainerConfig

F64 = torch.float64
EPS = 0.2

# settings at which each correction acts on part of the test data, not all of it
SPECS = {
    "none": OffPolicyNone(),
    "cap": OffPolicyCap(cap=1.3),
    "tis": OffPolicyTIS(cap=1.2),
    "mis": OffPolicyMIS(cap=1.5),
    "geo_mask": OffPolicyGeoMask(lo=0.9, hi=1.1),
    "icepop": OffPolicyIcePop(lo=0.8, hi=1.25),
    "m2po": OffPolicyM2PO(tau=0.03),
}


def ref_weights(spec, seqs):
    """Per sequence, per token: (c, dropped, truncated), by plain loops over python floats."""
    out = []
    for s in seqs:
        out.append([(0.0, False, False)] * len(s["lp"]))
    valid = [(i, t) for i, s in enumerate(seqs) for t in range(len(s["lp"])) if s["valid"][t]]

    def log_w(i, t):
        return seqs[i]["px"][t] - seqs[i]["bh"][t]

    for i, t in valid:
        w = math.exp(log_w(i, t))
        if spec.kind == "none":
            out[i][t] = (w, False, False)
        elif spec.kind == "cap":
            out[i][t] = (w, False, False) if w <= spec.cap else (0.0, True, False)
        elif spec.kind == "tis":
            out[i][t] = (min(w, spec.cap), False, w > spec.cap)
        elif spec.kind == "icepop":
            out[i][t] = (w, False, False) if spec.lo <= w <= spec.hi else (0.0, True, False)
        elif spec.kind in ("mis", "geo_mask"):
            logs = [log_w(i, k) for k in range(len(seqs[i]["lp"])) if seqs[i]["valid"][k]]
            if spec.kind == "mis":
                rho = math.exp(math.fsum(logs))
                out[i][t] = (rho, False, False) if rho <= spec.cap else (0.0, True, False)
            else:
                g = math.exp(math.fsum(logs) / len(logs))
                out[i][t] = (w, False, False) if spec.lo <= g <= spec.hi else (0.0, True, False)
    if spec.kind == "m2po":
        ranked = sorted(valid, key=lambda it: -(log_w(*it) ** 2))  # stable: ties keep token order
        m = [log_w(*it) ** 2 for it in ranked]
        k = 0
        while k < len(m) and sum(m[k:]) / (len(m) - k) > spec.tau:
            k += 1
        dropped = set(ranked[:k])
        for i, t in valid:
            out[i][t] = (0.0, True, False) if (i, t) in dropped else (math.exp(log_w(i, t)), False, False)
    return out


def reference(spec, seqs, lp=None):
    """(loss, gradient per sequence, stats) of the corrected decoupled loss; ``lp`` replaces the
    sequences' logp (for finite differences)."""
    weights = ref_weights(spec, seqs)
    total, grads, cs, n = 0.0, [], [], 0
    for i, s in enumerate(seqs):
        g = [0.0] * len(s["lp"])
        for t in range(len(s["lp"])):
            if not s["valid"][t]:
                continue
            n += 1
            c = weights[i][t][0]
            cs.append(c)
            x = s["lp"][t] if lp is None else lp[i][t]
            u, a = math.exp(x - s["px"][t]), s["adv"][t]
            u_clip = min(max(u, 1 - EPS), 1 + EPS)
            if u_clip * a < u * a:  # the clipped branch is strictly smaller: no gradient
                total -= c * u_clip * a
            else:
                total -= c * u * a
                g[t] = -c * u * a
        grads.append(g)
    masked = sum(d for i, row in enumerate(weights) for t, (_, d, _) in enumerate(row) if seqs[i]["valid"][t])
    trunc = sum(r for i, row in enumerate(weights) for t, (_, _, r) in enumerate(row) if seqs[i]["valid"][t])
    sq = sum(c * c for c in cs)
    stats = {
        "offpolicy_masked_fraction": masked / n,
        "offpolicy_truncated_fraction": trunc / n,
        "offpolicy_ess": sum(cs) ** 2 / (n * sq) if sq > 0 else 0.0,
        "offpolicy_weight_max": max(cs),
    }
    return total / n, [[x / n for x in g] for g in grads], stats


def make_seqs(seed, lengths=(5, 0, 8, 3, 7, 1, 6), spread=0.3):
    """Ragged sequences of float tokens; a few environment (untrained) tokens inside some."""
    gen = np.random.default_rng(seed)
    seqs = []
    for length in lengths:
        lp = -gen.random(length) * 3
        px = lp + spread * gen.standard_normal(length)
        bh = px + spread * gen.standard_normal(length)
        valid = [True] * length
        if length >= 5:
            valid[2] = False  # an environment token inside the answer
        seqs.append(
            {
                "lp": lp.tolist(),
                "px": px.tolist(),
                "bh": bh.tolist(),
                "adv": gen.standard_normal(length).tolist(),
                "valid": valid,
            }
        )
    for s in seqs:  # keep u away from the clip boundaries, where the gradient jumps
        for x, p in zip(s["lp"], s["px"]):
            assert min(abs(math.exp(x - p) - b) for b in (1 - EPS, 1 + EPS)) > 1e-4
    return seqs


def as_rows(seqs):
    """[batch, T] tensors (padding holds garbage) and the mask."""
    T = max(len(s["lp"]) for s in seqs)
    fill = {"lp": float("inf"), "px": float("-inf"), "bh": float("nan"), "adv": float("nan")}
    out = {k: torch.tensor([s[k] + [fill[k]] * (T - len(s[k])) for s in seqs], dtype=F64) for k in fill}
    out["mask"] = torch.tensor([s["valid"] + [False] * (T - len(s["valid"])) for s in seqs])
    return out


def as_packed(seqs):
    out = {k: torch.tensor([x for s in seqs for x in s[k]], dtype=F64) for k in ("lp", "px", "bh", "adv")}
    out["mask"] = torch.tensor([x for s in seqs for x in s["valid"]])
    return out


def run(spec, t, seq_lens=None, dtype=F64):
    lp = t["lp"].to(dtype).clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        lp,
        t["px"].to(dtype),
        t["bh"].to(dtype),
        t["adv"].to(dtype),
        t["mask"],
        eps_clip=EPS,
        off_policy=spec,
        seq_lens=seq_lens,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, stats


@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_correction_matches_reference(kind, layout):
    spec, seqs = SPECS[kind], make_seqs(seed=len(kind))
    ref_loss, ref_grad, ref_stats = reference(spec, seqs)
    if layout == "rows":
        loss, grad, stats = run(spec, as_rows(seqs))
        T = grad.shape[1]
        want = torch.tensor([g + [0.0] * (T - len(g)) for g in ref_grad], dtype=F64)
    else:
        loss, grad, stats = run(spec, as_packed(seqs), seq_lens=[len(s["lp"]) for s in seqs])
        want = torch.tensor([x for g in ref_grad for x in g], dtype=F64)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(grad.numpy(), want.numpy(), rtol=1e-10, atol=1e-14)
    for key, value in ref_stats.items():
        assert stats[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    # the data exercise the correction: it acts on some tokens, not all
    acted = ref_stats["offpolicy_masked_fraction"] + ref_stats["offpolicy_truncated_fraction"]
    assert (acted == 0.0) if kind == "none" else (0.0 < acted < 1.0)
    if kind == "tis":
        assert ref_stats["offpolicy_masked_fraction"] == 0.0 and ref_stats["offpolicy_weight_max"] == 1.2


@pytest.mark.parametrize("kind", list(SPECS))
def test_gradient_matches_finite_differences_of_the_reference(kind):
    spec, seqs = SPECS[kind], make_seqs(seed=7 + len(kind))
    _, grad, _ = run(spec, as_packed(seqs), seq_lens=[len(s["lp"]) for s in seqs])
    h, fd = 1e-6, []
    for i, s in enumerate(seqs):
        for t in range(len(s["lp"])):
            up = [list(x["lp"]) for x in seqs]
            down = [list(x["lp"]) for x in seqs]
            up[i][t] += h
            down[i][t] -= h
            fd.append((reference(spec, seqs, up)[0] - reference(spec, seqs, down)[0]) / (2 * h))
    np.testing.assert_allclose(grad.numpy(), fd, rtol=1e-5, atol=1e-8)
    assert any(abs(x) > 1e-3 for x in fd)  # not a trivially zero gradient


def test_mis_and_m2po_by_hand():
    # two sequences of log w (0.5, 0.5) and (0.2, -0.1): ratios e^1 = 2.72 (dropped at C = 2), e^0.1
    lw = torch.tensor([[0.5, 0.5], [0.2, -0.1]], dtype=F64)
    zero, mask = torch.zeros(2, 2, dtype=F64), torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0], [1.0, -2.0]], dtype=F64)
    lp = zero.clone().requires_grad_(True)  # u = 1: unclipped, d loss / d logp = -c A / n
    loss, stats = decoupled_ppo_loss(lp, zero, -lw, adv, mask, off_policy=OffPolicyMIS(cap=2.0))
    (grad,) = torch.autograd.grad(loss, lp)
    rho = math.exp(0.1)
    assert loss.item() == pytest.approx(-(rho * 1.0 + rho * -2.0) / 4)
    np.testing.assert_allclose(grad.numpy(), [[0.0, 0.0], [-rho / 4, 2 * rho / 4]], rtol=1e-12)
    assert stats["offpolicy_masked_fraction"] == 0.5 and stats["offpolicy_weight_max"] == pytest.approx(rho)
    # M2PO, values exact in binary. (log w)^2 = 1, 1/4, 1/4, 1/4: mean 7/16; without the 1 it is
    # 1/4 exactly, which tau = 1/4 accepts (<=): one token dropped, not all four
    ones = torch.ones(4, dtype=torch.bool)
    z1, adv1 = torch.zeros(4, dtype=F64), torch.ones(4, dtype=F64)

    def m2po(lw, tau):
        lp = z1.clone().requires_grad_(True)
        loss, stats = decoupled_ppo_loss(
            lp, z1, -torch.tensor(lw, dtype=F64), adv1, ones, off_policy=OffPolicyM2PO(tau=tau)
        )
        return torch.autograd.grad(loss, lp)[0], stats

    grad, stats = m2po([1.0, 0.5, -0.5, 0.5], 0.25)
    assert stats["offpolicy_masked_fraction"] == 0.25 and grad[0].item() == 0.0 and bool((grad[1:] != 0).all())
    assert m2po([1.0, 0.5, -0.5, 0.5], 0.2)[1]["offpolicy_masked_fraction"] == 1.0  # 1/4 alone is above 0.2
    # a tie, 1/4 and 1/4, then 1/16 twice: dropping one leaves 3/8 / 3 = 1/8 = tau; the earlier one goes
    grad, stats = m2po([0.5, -0.5, 0.25, 0.25], 0.125)
    assert stats["offpolicy_masked_fraction"] == 0.25 and grad[0].item() == 0.0 and grad[1].item() != 0.0


@pytest.mark.parametrize(
    "spec",
    [OffPolicyCap(cap=2.0), OffPolicyMIS(cap=2.0), OffPolicyGeoMask(), OffPolicyIcePop(), OffPolicyM2PO(tau=1e-6)],
    ids=lambda s: s.kind,
)
def test_everything_dropped_gives_zero_loss_and_gradient(spec):
    t = as_rows(make_seqs(seed=3))
    t["bh"] = t["px"] - 3.0  # w = e^3 = 20 everywhere: outside every band, above every cap
    loss, grad, stats = run(spec, t)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert stats["offpolicy_masked_fraction"] == 1.0
    assert stats["offpolicy_ess"] == 0.0 and stats["offpolicy_weight_max"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("kind", ["cap", "tis", "mis", "geo_mask", "icepop", "m2po"])
def test_overflowing_weights_stay_finite_in_float32(kind):
    seqs = make_seqs(seed=11)
    seqs[2]["bh"] = [p - 200.0 for p in seqs[2]["px"]]  # w = e^200: inf in float32, its sequence's too
    loss, grad, stats = run(SPECS[kind], as_rows(seqs), dtype=torch.float32)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(grad).all())
    assert grad[2].abs().sum().item() == 0.0 or kind == "tis"  # dropped, unless truncated to C
    assert math.isfinite(stats["offpolicy_ess"]) and math.isfinite(stats["offpolicy_weight_max"])


def test_sequence_kinds_need_the_sequences():
    t = as_packed(make_seqs(seed=1))
    n = t["lp"].numel()
    with pytest.raises(ValueError, match="works per sequence"):
        run(OffPolicyMIS(), t)
    with pytest.raises(ValueError, match="add up to"):
        run(OffPolicyGeoMask(), t, seq_lens=[n - 1])
    with pytest.raises(ValueError, match="packed 1-D"):
        run(OffPolicyMIS(), as_rows(make_seqs(seed=1)), seq_lens=[3, 4])
    assert run(OffPolicyMIS(), t, seq_lens=[n])[0].requires_grad  # one sequence of all tokens


@pytest.mark.parametrize(
    "value, field",
    [
        ({"kind": "tis", "cap": 0.5}, "off_policy.tis.cap"),
        ({"kind": "cap", "cap": 1.0}, "off_policy.cap.cap"),
        ({"kind": "mis", "cap": -2.0}, "off_policy.mis.cap"),
        ({"kind": "icepop", "lo": 1.5}, "off_policy.icepop.lo"),
        ({"kind": "icepop", "hi": 0.9}, "off_policy.icepop.hi"),
        ({"kind": "geo_mask", "lo": 0.0}, "off_policy.geo_mask.lo"),
        ({"kind": "m2po", "tau": 0.0}, "off_policy.m2po.tau"),
        ({"kind": "tis", "lo": 0.5}, "off_policy.tis.lo"),  # a setting of another kind
        ({"kind": "clip"}, "off_policy"),
    ],
)
def test_invalid_settings_name_the_field(value, field):
    with pytest.raises(ValidationError) as err:
        TrainerConfig(off_policy=value)
    assert field in str(err.value)


def test_config_forms():
    assert TrainerConfig().off_policy.kind == "none"
    assert TrainerConfig(off_policy="icepop").off_policy == OffPolicyIcePop(lo=0.5, hi=5.0)
    assert TrainerConfig(off_policy={"kind": "m2po", "tau": 0.1}).off_policy.tau == 0.1
    assert TrainerConfig(behav_weight_cap=None).off_policy.kind == "none"  # earlier runs' saved configs
    with pytest.raises(ValidationError, match=r"replaced by trainer.off_policy.*kind: cap, cap: 5"):
        TrainerConfig(behav_weight_cap=5.0)
    with pytest.raises(ValidationError, match=r"needs trainer\.objective = 'decoupled'"):
        TrainerConfig(objective="naive", off_policy={"kind": "tis"})


def test_set_overrides(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("trainer:\n  batch_size: 16\n")
    cfg = load_config(p, {"trainer.off_policy.kind": "icepop", "trainer.off_policy.hi": 3})
    assert cfg.trainer.off_policy == OffPolicyIcePop(lo=0.5, hi=3.0)
    with pytest.raises(
        ConfigError, match=r"trainer\.off_policy\.tis\.cap: Input should be greater than 1 \(got 0\.5\)"
    ):
        load_config(p, {"trainer.off_policy.kind": "tis", "trainer.off_policy.cap": 0.5})


def test_ppo_loss_takes_each_trajectory_as_a_sequence():
    """step_parts.ppo_loss hands the loss a micro-batch's answers one after another; the correction
    must see each trajectory's tokens as one sequence, in the micro-batch's order."""
    from areal_core.trainer.step_parts import PreparedBatch, ppo_loss

    seqs = make_seqs(seed=5, lengths=(4, 6, 2, 5))
    seqs[0]["bh"] = [p - 0.3 for p in seqs[0]["px"]]  # rho = e^1.2 > 1.5: dropped
    prep = PreparedBatch(
        seqs=[],
        starts=[],
        n_out=[len(s["lp"]) for s in seqs],
        rewards=torch.zeros(4),
        behav=[torch.tensor(s["bh"]) for s in seqs],
        adv=[torch.tensor(s["adv"]) for s in seqs],
        mask=[torch.tensor(s["valid"]) for s in seqs],
        n_trained=[sum(s["valid"]) for s in seqs],
        versions=[torch.zeros(len(s["lp"]), dtype=torch.long) for s in seqs],
    )
    idx = [2, 0, 3]  # micro-batching reorders the trajectories
    cfg = TrainerConfig(off_policy={"kind": "mis", "cap": 1.5})
    logp = torch.tensor([x for i in idx for x in seqs[i]["lp"]], requires_grad=True)
    prox = [torch.tensor(s["px"]) for s in seqs]
    loss, stats = ppo_loss(
        cfg,
        "recompute",
        logp,
        prep,
        idx,
        prox=prox,
        versions=None,
        version=0,
        n_tokens=sum(prep.n_trained[i] for i in idx),
    )
    ref_loss, _, ref_stats = reference(cfg.off_policy, [seqs[i] for i in idx])
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert stats["offpolicy_masked_fraction"] == pytest.approx(ref_stats["offpolicy_masked_fraction"])
    assert 0.0 < ref_stats["offpolicy_masked_fraction"] < 1.0


def test_trainer_step_reports_the_correction():
    """A Trainer step over several micro-batches: the trajectories whose behaviour logprobs sit one
    nat below the model's (w = e per token) are dropped whole by mis and geo_mask, so the step's
    masked fraction is their share of the tokens (token-weighted over micro-batches)."""
    from areal_core.models import build_char_tokenizer, build_tiny
    from areal_core.models.config import TinyArch
    from areal_core.trainer.packed_forward import response_logprobs
    from areal_core.trainer.trainer import Trainer
    from areal_core.types import Trajectory

    model = build_tiny(
        TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
        build_char_tokenizer(),
        seed=0,
    )
    rng = random.Random(0)
    batch, stale = [], {1, 4, 6}
    for i in range(8):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 6))]
        answer = [rng.randrange(3, 40) for _ in range(rng.randint(3, 25))]
        batch.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 4}",
                seq_no=i,
                admit_version=0,
                prompt_ids=prompt,
                output_ids=answer,
                output_logprobs=[0.0] * len(answer),
                output_versions=[0] * len(answer),
                finish_reason="stop",
                reward=float(i % 2),
            )
        )
    with torch.no_grad():
        logp = response_logprobs(
            model, [t.prompt_ids + t.output_ids for t in batch], [len(t.prompt_ids) for t in batch]
        ).split([len(t.output_ids) for t in batch])
    for i, (t, lp) in enumerate(zip(batch, logp)):
        t.output_logprobs = (lp - (1.0 if i in stale else 0.0)).tolist()
    n_stale = sum(len(t.output_ids) for i, t in enumerate(batch) if i in stale)
    n_all = sum(len(t.output_ids) for t in batch)
    for spec in ({"kind": "mis", "cap": 2.0}, {"kind": "geo_mask", "lo": 0.99, "hi": 1.01}):
        cfg = TrainerConfig(
            batch_size=8, max_tokens_per_microbatch=48, off_policy=spec, optim={"lr": 1e-12, "lr_schedule": "constant"}
        )
        stats = Trainer(model, cfg, temperature=1.0, total_steps=1).step(batch, 1).metrics
        assert stats["forward_passes"] > 1
        assert stats["offpolicy_masked_fraction"] == pytest.approx(n_stale / n_all, rel=1e-6)
        assert stats["offpolicy_truncated_fraction"] == 0.0
        assert stats["offpolicy_weight_max"] == pytest.approx(1.0, abs=1e-3)  # the kept ones: w ~ 1
        assert stats["behav_weight_max"] == pytest.approx(math.e, rel=1e-3)
