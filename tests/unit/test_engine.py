"""The rollout engine against plain Hugging Face forward passes (tiny random models, CPU)."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from areal_core.rollout.backends.embedded.engine import RequestError, RolloutEngine
from areal_core.rollout.backends.embedded.engine_parts import prefill_groups
from areal_core.rollout.backends.embedded.kv_forward import UnsupportedModelError
from areal_core.rollout.backends.embedded.launcher import server_seed

VOCAB = 64


def tiny_model(arch: str = "qwen2", seed: int = 0, **overrides) -> torch.nn.Module:
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        eos_token_id=3,
    )
    common.update(overrides)
    if arch == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=False, **common)
    elif arch == "mistral":
        cfg = MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
    else:  # SmolLM2-style Llama with tied embeddings
        cfg = LlamaConfig(tie_word_embeddings=True, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init: peakier, more varied outputs
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def run_to_end(engine: RolloutEngine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.step():
            return
    raise AssertionError("engine did not finish")


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    eos = model.config.eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


def hf_logprobs(model, prompt: list[int], out: list[int], temperature: float, top_k: int = 0) -> torch.Tensor:
    """logprob of each output token under ``model`` given prompt + the preceding outputs
    (with ``top_k``: under the distribution renormalised over the k most likely tokens)."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    logits = logits / t
    if top_k:
        kth = torch.topk(logits, top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


PROMPTS = [
    [5],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36],
    [40, 41],
    [50] * 13,
]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_hf_generate_with_continuous_batching(arch):
    model = tiny_model(arch, seed=1)
    if arch == "llama":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    engine = RolloutEngine(copy.deepcopy(model), start=False, kv_slots=2, kv_capacity=8)
    greedy = dict(temperature=0.0, max_new_tokens=40)
    futs = [engine.submit(p, greedy) for p in PROMPTS[:3]]
    for _ in range(5):
        engine.step()
    assert engine.running == 3 and all(not f.done() for f in futs)
    futs += [engine.submit(p, greedy) for p in PROMPTS[3:]]  # join the running batch
    run_to_end(engine)
    assert engine.kv.slots == 0  # released when idle
    for p, f in zip(PROMPTS, futs):
        r = f.result()
        want = hf_greedy(model, p, 40)
        assert r.output_ids == want
        assert r.meta_info.finish_reason.type == ("stop" if want[-1] == 3 else "length")
        assert r.meta_info.prompt_tokens == len(p) and r.meta_info.completion_tokens == len(want)


def test_greedy_ignore_eos_crosses_capacity_growth_with_chunked_prefill():
    model = tiny_model("qwen2", seed=2)
    engine = RolloutEngine(copy.deepcopy(model), start=False, kv_slots=1, kv_capacity=4, prefill_tokens=24)
    engine.kv.attn_chunk_bytes = 2048  # several query chunks per prefill
    futs = [engine.submit(p, dict(temperature=0.0, max_new_tokens=50, ignore_eos=True)) for p in PROMPTS]
    run_to_end(engine)
    for p, f in zip(PROMPTS, futs):
        want = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=50, min_new_tokens=50, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        assert f.result().output_ids == want


def _check_logprobs(models: dict[int, torch.nn.Module], prompt, resp, temperature, top_k: int = 0):
    out, versions = resp.output_ids, resp.meta_info.output_token_versions
    got = torch.tensor([lp for lp, _, _ in resp.meta_info.output_token_logprobs])
    assert [t for _, t, _ in resp.meta_info.output_token_logprobs] == out
    assert len(versions) == len(out) and versions == sorted(versions)
    for v, model in models.items():
        sel = torch.tensor([x == v for x in versions])
        if sel.any():
            want = hf_logprobs(model, prompt, out, temperature, top_k)
            torch.testing.assert_close(got[sel], want[sel], atol=1e-4, rtol=0)


@pytest.mark.parametrize("threaded", [False, True])
def test_interruptible_update_reprefills_with_new_weights(tmp_path, threaded):
    old, new = tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=4)
    new.save_pretrained(tmp_path / "v1")
    max_new = 24 if not threaded else 200
    engine = RolloutEngine(copy.deepcopy(old), start=threaded, kv_slots=2, kv_capacity=8)
    reqs = [(p, dict(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)) for p in PROMPTS[:4]]
    reqs.append((PROMPTS[4], dict(temperature=0.7, top_k=5, max_new_tokens=max_new, ignore_eos=True)))
    futs = [engine.submit(p, {**s, "sampling_seed": i}) for i, (p, s) in enumerate(reqs)]
    if threaded:
        deadline = time.monotonic() + 30
        while engine.generated_tokens < 5 * 20 and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.update_weights(str(tmp_path / "v1"), 1).result(timeout=30)
        resps = [f.result(timeout=60) for f in futs]
        engine.shutdown()
    else:
        for _ in range(8):
            engine.step()
        upd = engine.update_weights(str(tmp_path / "v1"), 1)
        engine.step()
        assert upd.done() and engine.version == 1
        run_to_end(engine)
        resps = [f.result() for f in futs]
    assert all(r.meta_info.weight_version == 1 for r in resps)
    crossing = [r for r in resps if set(r.meta_info.output_token_versions) == {0, 1}]
    assert crossing, "no sequence was generated across the update"
    for (p, s), r in zip(reqs, resps):
        _check_logprobs({0: old, 1: new}, p, r, s["temperature"], s.get("top_k", 0))


def test_non_interruptible_update_waits_for_running_sequences(tmp_path):
    old, new = tiny_model("llama", seed=5), tiny_model("llama", seed=6)
    new.save_pretrained(tmp_path / "v1")
    engine = RolloutEngine(copy.deepcopy(old), start=False, weight_update="drain")
    s = dict(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    first = [engine.submit(p, s) for p in PROMPTS[:3]]
    for _ in range(5):
        engine.step()
    upd = engine.update_weights(str(tmp_path / "v1"), 1)
    late = engine.submit(PROMPTS[3], s)
    engine.step()
    assert not upd.done() and engine.waiting == 1  # no admission while draining
    run_to_end(engine)
    assert upd.done() and engine.version == 1
    for p, f in zip(PROMPTS[:3], first):
        r = f.result()
        assert set(r.meta_info.output_token_versions) == {0}
        _check_logprobs({0: old}, p, r, 1.0)
    r = late.result()
    assert set(r.meta_info.output_token_versions) == {1}
    _check_logprobs({1: new}, PROMPTS[3], r, 1.0)


def test_bad_weight_folder_leaves_engine_intact(tmp_path):
    engine = RolloutEngine(tiny_model("qwen2"), start=False)
    with pytest.raises(FileNotFoundError):
        engine.update_weights(str(tmp_path / "missing"), 1)
    tiny_model("qwen2", hidden_size=32).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(str(tmp_path / "other"), 1)
    assert engine.version == 0


def _logits_at_start(model, prompt, temperature=1.0):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1] / temperature


def test_sampling_top_k_top_p_stop_and_length():
    model = tiny_model("qwen2", seed=7)
    engine = RolloutEngine(copy.deepcopy(model), start=False)
    p = PROMPTS[1]
    greedy = engine.submit(p, dict(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    top1 = engine.submit(p, dict(temperature=1.0, top_k=1, max_new_tokens=16, ignore_eos=True))
    nucleus = engine.submit(p, dict(temperature=1.0, top_p=1e-6, max_new_tokens=16, ignore_eos=True))
    top3 = [engine.submit(p, dict(temperature=2.0, top_k=3, max_new_tokens=1, sampling_seed=i)) for i in range(40)]
    seeded = [
        engine.submit(p, dict(temperature=1.0, max_new_tokens=16, ignore_eos=True, sampling_seed=s))
        for s in (123, 123, 124)
    ]
    run_to_end(engine)
    g = greedy.result()
    assert g.meta_info.finish_reason.type == "length" and len(g.output_ids) == 16
    assert top1.result().output_ids == g.output_ids
    # top-1 samples from a point mass: its behaviour logprob is 0, not log_softmax(logits) at the argmax
    assert all(abs(lp) < 1e-6 for lp, _, _ in top1.result().meta_info.output_token_logprobs)
    assert nucleus.result().output_ids == g.output_ids
    allowed = set(torch.topk(_logits_at_start(model, p), 3).indices.tolist())
    firsts = {f.result().output_ids[0] for f in top3}
    assert firsts <= allowed and len(firsts) > 1
    # sampling_seed: the same seed gives the same answer (in one batch), another seed another one
    assert seeded[0].result().output_ids == seeded[1].result().output_ids != seeded[2].result().output_ids
    # a stop token ends generation and is included in the output
    k = next(i for i, t in enumerate(g.output_ids) if i >= 3 and t not in g.output_ids[:i])
    stop = g.output_ids[k]
    s = engine.submit(p, dict(temperature=0.0, max_new_tokens=16, stop_token_ids=[stop], ignore_eos=True))
    run_to_end(engine)
    r = s.result()
    assert r.output_ids == g.output_ids[: k + 1]
    assert r.meta_info.finish_reason.type == "stop" and r.meta_info.finish_reason.matched == stop


def test_servers_seeded_like_the_launcher_sample_apart_and_reproduce():
    """Embedded server k of a run samples with server_seed(run seed, k): the servers answer the
    same prompt at temperature 1 differently, and the same (seed, index) answers the same again."""
    model = tiny_model("qwen2", seed=7)

    def answers(run_seed: int, index: int) -> list[list[int]]:
        engine = RolloutEngine(copy.deepcopy(model), seed=server_seed(run_seed, index), start=False)
        futs = [engine.submit(PROMPTS[1], dict(temperature=1.0, max_new_tokens=16, ignore_eos=True)) for _ in range(4)]
        run_to_end(engine)
        return [f.result().output_ids for f in futs]

    first = answers(5, 0)
    assert answers(5, 1) != first and answers(6, 0) != first
    assert answers(5, 0) == first
    assert len({server_seed(5, k) for k in range(64)} | {server_seed(6, k) for k in range(64)}) == 128


def test_model_eos_stops_unless_ignored():
    model = tiny_model("llama", seed=8)
    engine = RolloutEngine(copy.deepcopy(model), start=False)
    g = engine.submit(PROMPTS[0], dict(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    run_to_end(engine)
    out = g.result().output_ids
    k = next(i for i, t in enumerate(out) if i >= 2 and t not in out[:i])
    engine.eos_ids = [out[k]]
    a = engine.submit(PROMPTS[0], dict(temperature=0.0, max_new_tokens=12))
    b = engine.submit(PROMPTS[0], dict(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    run_to_end(engine)
    assert a.result().output_ids == out[: k + 1]
    assert a.result().meta_info.finish_reason.matched == out[k]
    assert b.result().output_ids == out


def test_request_validation():
    engine = RolloutEngine(tiny_model("qwen2", max_position_embeddings=32), start=False)
    with pytest.raises(RequestError, match="context of 32"):
        engine.submit([1] * 20, dict(max_new_tokens=13))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.submit([1, VOCAB], dict(max_new_tokens=1))
    with pytest.raises(RequestError, match="sampling"):
        engine.submit([1], dict(top_k=-3))
    with pytest.raises(RequestError, match="sampling_seed"):
        engine.submit([1], dict(max_new_tokens=1, sampling_seed=-1))
    f = engine.submit([1] * 20, dict(max_new_tokens=12, ignore_eos=True))
    run_to_end(engine)
    assert len(f.result().output_ids) == 12


def test_pause_resume_and_abort():
    engine = RolloutEngine(tiny_model("qwen2"), start=False)
    f = engine.submit(PROMPTS[1], dict(max_new_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    done = engine.generated_tokens
    engine.pause()
    assert engine.step() is False and engine.paused
    assert engine.generated_tokens == done and engine.running == 1
    engine.resume()
    engine.step()
    assert engine.generated_tokens == done + 1
    engine.abort_all()
    engine.step()
    r = f.result()
    assert r.meta_info.finish_reason.type == "abort" and len(r.output_ids) == done + 1
    assert engine.running == 0


def test_threaded_engine_serves_and_shuts_down():
    engine = RolloutEngine(tiny_model("llama"), max_running=4)
    futs = [engine.submit(PROMPTS[i % 6], dict(max_new_tokens=10, ignore_eos=True)) for i in range(12)]
    assert all(len(f.result(timeout=30).output_ids) == 10 for f in futs)
    engine.pause().result(timeout=10)
    pending = engine.submit(PROMPTS[0], dict(max_new_tokens=10))
    engine.shutdown()
    assert pending.result(timeout=10).meta_info.finish_reason.type == "abort"
    assert not engine.alive()


def test_unsupported_architectures_are_named():
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        RolloutEngine(tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0), start=False)
    from transformers import GPT2Config

    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        RolloutEngine(gpt2, start=False)


def test_update_while_paused_applies_on_the_spot(tmp_path):
    old, new = tiny_model("qwen2", seed=9), tiny_model("qwen2", seed=10)
    new.save_pretrained(tmp_path / "v1")
    engine = RolloutEngine(copy.deepcopy(old), start=False)
    s = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    futs = [engine.submit(p, s) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    engine.pause()
    assert engine.info().last_update_stall_s is None
    upd = engine.update_weights(str(tmp_path / "v1"), 1)
    assert engine.step() is False
    assert upd.done() and engine.version == 1 and engine.running == 3  # AReaL: pause -> update -> continue
    assert 0 < engine.info().last_update_stall_s < 5  # the loop's time swapping the weights in
    engine.resume()
    run_to_end(engine)
    for p, f in zip(PROMPTS[:3], futs):
        r = f.result()
        assert r.meta_info.output_token_versions[0] == 0 and r.meta_info.output_token_versions[-1] == 1
        _check_logprobs({0: old, 1: new}, p, r, 1.0)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on():
    engine = RolloutEngine(tiny_model("qwen2"), start=False)
    f = engine.submit(PROMPTS[0], dict(max_new_tokens=5, ignore_eos=True))
    engine.step()  # prefill
    decode = engine.kv.decode

    def broken(*args):
        raise RuntimeError("boom")

    engine.kv.decode = broken
    engine.step()
    with pytest.raises(RuntimeError, match="boom"):
        f.result()
    engine.kv.decode = decode
    g = engine.submit(PROMPTS[1], dict(max_new_tokens=5, ignore_eos=True))
    run_to_end(engine)
    assert len(g.result().output_ids) == 5 and engine.running == 0


def test_prefill_groups_cut_greedily_under_the_padded_token_budget():
    assert prefill_groups({0: 5, 1: 3, 2: 4}, 100) == [[1, 2, 0]]  # ascending length, one pass
    assert prefill_groups({7: 50, 8: 50, 9: 50}, 100) == [[7, 8], [9]]  # ties keep their order
    assert prefill_groups({0: 300, 1: 10}, 100) == [[1], [0]]  # too long for the budget: alone
    rng = random.Random(0)
    for _ in range(200):
        lengths = {i: rng.randint(1, 60) for i in rng.sample(range(100), rng.randint(1, 30))}
        budget = rng.randint(1, 400)
        groups = prefill_groups(lengths, budget)
        flat = [i for g in groups for i in g]
        assert sorted(flat) == sorted(lengths)  # every sequence exactly once
        assert [lengths[i] for i in flat] == sorted(lengths.values())  # in ascending length
        for g, nxt in zip(groups, groups[1:] + [None]):
            padded = len(g) * max(lengths[i] for i in g)
            assert len(g) == 1 or padded <= budget  # within budget, unless alone
            if nxt is not None:  # greedy: the next sequence would have broken the budget
                assert (len(g) + 1) * lengths[nxt[0]] > budget


def test_identical_requests_are_prefilled_once_and_sample_apart():
    """A group's answers to one prompt arrive together: the prompt is run once and its cache row copied;
    each answer samples on its own, with logprobs equal to the HF model's, and greedy copies agree."""
    model = tiny_model("qwen2", seed=5)
    engine = RolloutEngine(copy.deepcopy(model), start=False, kv_slots=4, kv_capacity=8)
    ran = []
    prefill = engine.kv.prefill
    engine.kv.prefill = lambda rows, seqs: (ran.extend(map(len, seqs)), prefill(rows, seqs))[1]
    prompt = PROMPTS[1]
    sampled = [engine.submit(prompt, dict(temperature=1.0, max_new_tokens=12)) for _ in range(6)]
    greedy = [engine.submit(PROMPTS[3], dict(temperature=0.0, max_new_tokens=12)) for _ in range(2)]
    run_to_end(engine)
    assert sorted(ran) == sorted([len(prompt), len(PROMPTS[3])])  # one forward over each prompt
    outs = [f.result() for f in sampled]
    assert len({tuple(r.output_ids) for r in outs}) > 1  # the copies sample apart
    for r in outs:
        _check_logprobs({0: model}, prompt, r, 1.0)
    want = hf_greedy(model, PROMPTS[3], 12)
    assert [f.result().output_ids for f in greedy] == [want, want]


@pytest.mark.parametrize("query_first", [False, True])
def test_split_decode_attention_matches_hf(query_first):
    """With rows of very different lengths the decode attention runs in two parts (all rows over the
    first positions, the long rows over the rest, merged by their softmax maxima and sums); greedy
    outputs stay HF's, with the score products either way round, and the split is really taken."""
    model = tiny_model("qwen2", seed=6)
    engine = RolloutEngine(copy.deepcopy(model), start=False, kv_slots=8, kv_capacity=16)
    engine.kv.split_min_positions = 1
    engine.kv.query_first_scores = query_first
    taken = []
    split_at = engine.kv._split_at
    engine.kv._split_at = lambda lengths, L: (lambda r: (taken.append(r is not None), r)[1])(split_at(lengths, L))
    prompts = [[7] * 60, [9, 10], [11], [12, 13, 14], [15] * 45, [16, 17]]
    futs = [engine.submit(p, dict(temperature=0.0, max_new_tokens=20)) for p in prompts]
    run_to_end(engine)
    assert any(taken)
    for p, f in zip(prompts, futs):
        assert f.result().output_ids == hf_greedy(model, p, 20)
