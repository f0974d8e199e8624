"""Multi-turn answers carry a loss mask: environment and tool tokens inside an answer are context,
never trained. Checked against an independent reference gradient (HF forward, hand-written loss
over the policy's tokens only), with a control that the mask matters."""

import pytest
import torch

from areal_core.models import build_char_tokenizer, build_tiny
from areal_core.models.config import TinyArch
from areal_core.run.metrics import ledger_rows
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.step_parts import ppo_loss, prepare_batch
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory

VERSION = 7


def _model():
    return build_tiny(
        TinyArch(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64),
        build_char_tokenizer(),
        seed=0,
    )


def _batch(model):
    """Two groups; the first answer is multi-turn: policy tokens, 4 environment tokens, policy tokens.
    Behaviour logprobs are the model's own (ratio 1), environment tokens' are junk (-30)."""
    specs = [
        ([5, 9, 11], [14, 15, 16, 20, 21, 22, 23, 30, 31], [1, 1, 1, 0, 0, 0, 0, 1, 1], 5.0, "a"),
        ([5, 9, 11], [17, 18, 19], [], -5.0, "a"),
        ([6, 7], [24, 25, 26, 27, 28, 29], [1, 0, 0, 1, 1, 1], 5.0, "b"),
        ([6, 7], [33, 34], [], -5.0, "b"),
    ]
    out = []
    for i, (prompt, answer, mask, reward, group) in enumerate(specs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(answer)[:, None])[:, 0].tolist()
        lp = [x if (not mask or m) else -30.0 for x, m in zip(lp, mask or [1] * len(answer))]
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=group,
                seq_no=i,
                admit_version=VERSION,
                prompt_ids=prompt,
                output_ids=answer,
                output_logprobs=lp,
                output_versions=[VERSION] * len(answer),
                output_mask=mask,
                finish_reason="stop",
                reward=reward,
            )
        )
    return out


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _trainer_grad(model, batch, objective):
    cfg = TrainerConfig(batch_size=4, max_tokens_per_microbatch=64, objective=objective, adv_norm="none")
    trainer = Trainer(model, cfg, temperature=1.0, total_steps=1)
    prep = prepare_batch(batch, cfg.adv_norm)
    model.zero_grad(set_to_none=True)
    idx = list(range(len(batch)))
    logp = trainer._logprobs(prep.seqs, prep.starts, idx)
    loss, _ = ppo_loss(
        cfg,
        trainer.prox_path(1),
        logp,
        prep,
        idx,
        prox=None,
        versions=None,
        version=VERSION,
        n_tokens=sum(prep.n_trained),
    )
    loss.backward()
    return _grads(model), float(loss.detach())


def _reference_grad(model, batch, use_mask=True):
    """-(1/N) sum over trained tokens of A * d logp (PPO's gradient at ratio 1), by plain HF forwards."""
    model.zero_grad(set_to_none=True)
    terms, n = [], 0
    for t in batch:
        logits = model(torch.tensor([t.prompt_ids + t.output_ids])).logits[0, len(t.prompt_ids) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(t.output_ids)[:, None])[:, 0]
        keep = (
            torch.tensor(t.output_mask, dtype=torch.bool)
            if (t.output_mask and use_mask)
            else torch.ones(len(t.output_ids), dtype=torch.bool)
        )
        terms.append(t.reward * lp[keep].sum())
        n += int(keep.sum())
    (-sum(terms) / n).backward()
    return _grads(model)


@pytest.mark.parametrize("objective", ["naive", "decoupled"])
def test_environment_tokens_get_no_gradient(objective):
    model = _model()
    batch = _batch(model)
    got, _loss = _trainer_grad(model, batch, objective)
    want = _reference_grad(model, batch)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), float((got - want).abs().max())
    # control: the same batch trained on every token gives another gradient
    assert not torch.allclose(_reference_grad(model, batch, use_mask=False), want, rtol=1e-3, atol=1e-5)


def test_environment_tokens_do_not_move_the_loss_or_the_stats():
    model = _model()
    batch = _batch(model)
    _, loss = _trainer_grad(model, batch, "decoupled")
    for t in batch:  # junk in what the loss must not read: environment tokens' logprobs and versions
        if t.output_mask:
            t.output_logprobs = [lp if m else 99.0 for lp, m in zip(t.output_logprobs, t.output_mask)]
            t.output_versions = [v if m else -100 for v, m in zip(t.output_versions, t.output_mask)]
    _, loss2 = _trainer_grad(model, batch, "decoupled")
    assert loss2 == pytest.approx(loss, rel=1e-6)
    cfg = TrainerConfig(batch_size=4, max_tokens_per_microbatch=64)
    stats = Trainer(model, cfg, temperature=1.0, total_steps=1).step(batch, VERSION).metrics
    assert stats["tokens_trained"] == 5 + 3 + 4 + 2 and stats["staleness_max"] == 0
    rows = ledger_rows(batch, 1, VERSION)
    assert [r["min_token_version"] for r in rows] == [VERSION] * 4 and rows[0]["n_tokens"] == 9


@pytest.mark.parametrize(
    "mask, match", [([1, 1], "one 0 or 1 per output token"), ([1, 2, 1], "one 0 or 1"), ([0, 0, 0], "trains no token")]
)
def test_bad_masks_are_named(mask, match):
    t = Trajectory(
        traj_id="bad",
        group_id="g",
        seq_no=0,
        admit_version=0,
        prompt_ids=[5],
        output_ids=[6, 7, 8],
        output_logprobs=[-1.0] * 3,
        output_versions=[0] * 3,
        output_mask=mask,
        finish_reason="stop",
        reward=1.0,
    )
    with pytest.raises(ValueError, match=f"trajectory bad: .*{match}"):
        prepare_batch([t], "none")
