"""The openai_agent episode and its OpenAI-compatible endpoint, driven by the real ``openai``
client: what a conversation records (token ids, behaviour logprobs, versions, the loss mask)
across several calls, concurrent conversations kept apart, OpenAI-style errors for bad requests,
and one short real run through the controller with the tiny model."""

import asyncio
import re
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")

from areal_core.episodes import make_episode  # noqa: E402
from areal_core.episodes.config import OpenAIAgentConfig  # noqa: E402
from areal_core.episodes.openai_agent import OpenAIAgent  # noqa: E402
from areal_core.reward.result import RewardResult  # noqa: E402
from areal_core.types import Trajectory  # noqa: E402

EOS = 0  # the scripted tokenizer's end of turn: written "<E>" in a template, invisible when decoded


class ScriptedContext:
    """A policy that answers from a script (per trajectory, per call) and ends each answer with EOS;
    token ids are character codes, logprobs count down per token, the version moves on after every
    turn. Answers are right when they read 'ok'."""

    def __init__(self, script: dict[str, list[str]], limit: int | None = None, refuse: dict | None = None):
        self.script, self.calls, self.version, self.graded = script, dict.fromkeys(script, 0), 5, []
        self.stop_ids, self.max_new = [], []
        self.limit = limit  # tokens a trajectory may hold (None: no limit), as the controller's room says
        self.refuse = refuse or {}  # trajectory id -> the call (0, 1, ...) the rollout server answers 400

    def room(self, traj):
        return None if self.limit is None else self.limit - len(traj.prompt_ids) - len(traj.output_ids)

    async def generate(self, trajs, max_new_tokens=None, stop_token_ids=()):
        from areal_core.rollout.client import RolloutServerError

        self.stop_ids.append(list(stop_token_ids))
        self.max_new.append(max_new_tokens)
        for t in trajs:
            if self.refuse.get(t.traj_id) == self.calls[t.traj_id]:
                raise RolloutServerError(
                    "http://127.0.0.1:1",
                    400,
                    "POST /generate: prompt (70 tokens) + "
                    "max_new_tokens (64) = 134 exceeds the model's context of 128 positions",
                )
        for t in trajs:
            text = self.script[t.traj_id][self.calls[t.traj_id]]
            self.calls[t.traj_id] += 1
            await asyncio.sleep(0.01)  # other conversations run meanwhile
            ids = self.encode(text) + [EOS]
            for k, tok in enumerate(ids):
                if tok in stop_token_ids:
                    ids = ids[: k + 1]
                    break
            ids = ids[: max_new_tokens or None]
            if t.output_mask:
                t.output_mask += [1] * len(ids)
            t.output_ids += ids
            t.output_logprobs += [-0.01 * (len(t.output_logprobs) + i + 1) for i in range(len(ids))]
            t.output_versions += [self.version] * len(ids)
            t.finish_reason = "stop" if ids[-1] in (EOS, *stop_token_ids) else "length"
        self.version += 1

    async def grade(self, trajs, texts):
        self.graded.append(list(texts))
        return [RewardResult(correct=x == "ok", parsed=x, reason="ok" if x == "ok" else "wrong") for x in texts]

    def encode(self, text):
        return [EOS if p == "<E>" else ord(p) for p in re.findall(r"<E>|[\s\S]", text)]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != EOS)


def _group(n, prompt="a3b5="):
    return [
        Trajectory(traj_id=f"t{i}", group_id="g", seq_no=i, admit_version=5, prompt_ids=[ord(c) for c in prompt])
        for i in range(n)
    ]


def _run(episode, group, ctx):
    return asyncio.run(episode.run(group, ctx))


def _policy_text(traj, ctx):
    mask = traj.output_mask or [1] * len(traj.output_ids)
    return ctx.decode([i for i, m in zip(traj.output_ids, mask) if m])


def three_calls(client, prompt):
    llm = openai.OpenAI(**client)
    seen = []
    r1 = llm.completions.create(model="m", prompt="Q:" + prompt)
    seen.append(r1)
    r2 = llm.completions.create(model="m", prompt="Q:" + prompt + r1.choices[0].text + "\nobs\n")
    seen.append(r2)
    r3 = llm.completions.create(
        model="m", prompt="Q:" + prompt + r1.choices[0].text + "\nobs\n" + r2.choices[0].text + "!", max_tokens=2
    )
    seen.append(r3)
    three_calls.seen = seen
    return r3.choices[0].text


def test_a_three_call_conversation_is_one_trajectory_with_its_mask():
    ctx = ScriptedContext({"t0": ["x1", "yy2", "okay"]})
    [traj] = group = _group(1)
    [result] = _run(OpenAIAgent(three_calls), group, ctx)
    r1, r2, r3 = three_calls.seen
    # what the client got: OpenAI-shaped, parsed by the real client
    assert [r.choices[0].text for r in (r1, r2, r3)] == ["x1", "yy2", "ok"]
    assert [r.choices[0].finish_reason for r in (r1, r2, r3)] == ["stop", "stop", "length"]
    assert r1.object == "text_completion" and r1.id.startswith("cmpl-") and r1.model == "m"
    assert (r1.usage.prompt_tokens, r1.usage.completion_tokens) == (len("Q:a3b5="), 3)  # x, 1, EOS
    assert (r2.usage.prompt_tokens, r2.usage.completion_tokens) == (len("Q:a3b5=") + 3 + len("\nobs\n"), 4)
    # the final answer ("ok", cut at max_tokens=2) is what was graded
    assert ctx.graded == [["ok"]] and result.correct
    assert traj.reward_info["turns"] == 3
    # the trajectory: the first call's prompt, then answer, environment, answer, environment, answer
    assert traj.prompt_ids == ctx.encode("Q:a3b5=")
    E = [EOS]
    assert traj.output_ids == ctx.encode("x1") + E + ctx.encode("\nobs\n") + ctx.encode("yy2") + E + [
        ord("!")
    ] + ctx.encode("ok")
    assert traj.output_mask == [1] * 3 + [0] * 5 + [1] * 4 + [0] + [1] * 2
    assert _policy_text(traj, ctx) == "x1yy2ok"
    # behaviour logprobs as the policy reported them; placeholders (0) for environment tokens
    lp = traj.output_logprobs
    assert lp[:3] == pytest.approx([-0.01, -0.02, -0.03]) and lp[3:8] == [0.0] * 5
    assert lp[8:12] == pytest.approx([-0.09, -0.10, -0.11, -0.12]) and lp[12] == 0.0
    # versions: each turn's sampling version; environment text gets the version when it was added
    assert traj.output_versions == [5] * 3 + [6] * 5 + [6] * 4 + [7] + [7] * 2
    assert len(traj.output_ids) == len(traj.output_logprobs) == len(traj.output_versions) == len(traj.output_mask)
    assert traj.finish_reason == "length"


CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<E>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_twice(client, prompt):
    llm = openai.OpenAI(**client)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    first = llm.chat.completions.create(model="m", messages=msgs)
    chat_twice.first = first
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    return llm.chat.completions.create(model="m", messages=msgs).choices[0].message.content


def test_chat_turns_through_a_chat_template():
    ctx = ScriptedContext({"t0": ["no", "ok"]})
    [traj] = group = _group(1)
    [result] = _run(OpenAIAgent(chat_twice, chat_template=CHATML), group, ctx)
    first = chat_twice.first
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == "no" and result.correct
    assert traj.prompt_ids == ctx.encode("<|system|>be brief<E><|user|>a3b5=<E><|assistant|>")
    # the template's end-of-turn after the answer is the EOS the policy sampled: not added twice
    env = ctx.encode("<|user|>sure?<E><|assistant|>")
    assert traj.output_ids == ctx.encode("no") + [EOS] + env + ctx.encode("ok") + [EOS]
    assert traj.output_mask == [1] * 3 + [0] * len(env) + [1] * 3


def test_a_tokenizer_chat_template_and_the_prompt_the_agent_gets(tmp_path):
    """``tokenizer:``: its chat template renders chats, and the agent gets the user message of a
    dataset prompt that was encoded with that template (not the template's text around it)."""
    from areal_core.episodes.openai_agent import ChatRenderer
    from areal_core.models import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok.save_pretrained(tmp_path)
    render = ChatRenderer(tokenizer=str(tmp_path))
    chat = [{"role": "user", "content": "a3b5="}]
    assert render(chat) == "[user]a3b5=<eos>[assistant]"
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert render.user_text(list(ids)) == "a3b5="
    assert render.user_text(tok.encode("a3b5=", add_special_tokens=False)) is None  # not this template's
    assert ChatRenderer().user_text(list(ids)) is None  # no tokenizer: the prompt as decoded
    build_char_tokenizer().save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="has no chat template"):
        ChatRenderer(tokenizer=str(tmp_path / "plain"))


def test_plain_chat_rendering_and_the_api_key_route():
    """Without a template, a chat is its messages' contents in a row (the char model's prompts);
    an agent with a fixed base_url can name its conversation by the API key instead."""
    ctx = ScriptedContext({"t0": ["a3=3|3"]})

    def agent(client, prompt):
        llm = openai.OpenAI(base_url=client["base_url"].split("/c/")[0] + "/v1", api_key=client["api_key"])
        assert [m.id for m in llm.models.list()] == ["policy"]
        return (
            llm.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
            .choices[0]
            .message.content
        )

    [traj] = group = _group(1, "a3=")
    _run(OpenAIAgent(agent), group, ctx)
    assert traj.prompt_ids == ctx.encode("a3=") and ctx.graded == [["a3=3|3"]]


def test_concurrent_conversations_are_kept_apart():
    n = 6
    ctx = ScriptedContext({f"t{i}": [f"first{i}", f"second{i}"] for i in range(n)})
    both_in = threading.Barrier(n, timeout=30)

    def agent(client, prompt, tag):
        llm = openai.OpenAI(**client)
        a = llm.completions.create(model="m", prompt=prompt).choices[0].text
        both_in.wait()  # every conversation has had its first call before any makes its second
        b = llm.completions.create(model="m", prompt=prompt + a + tag).choices[0].text
        return a + b

    async def async_agent(client, prompt, tag):
        llm = openai.AsyncOpenAI(**client)
        a = (await llm.completions.create(model="m", prompt=prompt)).choices[0].text
        b = (await llm.completions.create(model="m", prompt=prompt + a + tag)).choices[0].text
        return a + b

    for fn in (agent, async_agent):
        ctx = ScriptedContext({f"t{i}": [f"first{i}", f"second{i}"] for i in range(n)})
        group = _group(n)
        _run(OpenAIAgent(fn, options={"tag": "#"}), group, ctx)
        assert ctx.graded == [[f"first{i}second{i}" for i in range(n)]]
        for i, t in enumerate(group):
            assert t.output_ids == ctx.encode(f"first{i}") + [EOS] + ctx.encode("#") + ctx.encode(f"second{i}") + [EOS]
            assert t.output_mask == [1] * (len(f"first{i}") + 1) + [0] + [1] * (len(f"second{i}") + 1)


def test_stop_strings_end_the_answer_before_them():
    ctx = ScriptedContext({"t0": ["a3=3,b5=8|8", "8"], "t1": ["a3=3;;b5|8", "x"]})

    def agent(client, prompt, stop):
        llm = openai.OpenAI(**client)
        work = llm.completions.create(model="m", prompt=prompt, stop=stop)
        assert work.choices[0].finish_reason == "stop"
        final = llm.completions.create(model="m", prompt=prompt + work.choices[0].text + "|")
        return work.choices[0].text + "|" + final.choices[0].text

    # one token: generation stops there (stop_token_ids), and the stop token is not kept
    [t0] = g0 = _group(1)
    _run(OpenAIAgent(agent, options={"stop": "|"}), g0, ctx)
    assert ctx.stop_ids[0] == [ord("|")] and ctx.graded[-1] == ["a3=3,b5=8|8"]
    assert t0.output_ids == ctx.encode("a3=3,b5=8") + ctx.encode("|") + ctx.encode("8") + [EOS]
    assert t0.output_mask == [1] * 9 + [0] + [1] * 2
    # longer: cut afterwards; the answer's tokens from the stop string on are dropped
    g1 = _group(2)[1:]
    _run(OpenAIAgent(agent, options={"stop": [";;", "zz"]}), g1, ctx)
    assert ctx.stop_ids[-2] == [] and ctx.graded[-1] == ["a3=3|x"]
    assert g1[0].output_ids == ctx.encode("a3=3") + ctx.encode("|") + ctx.encode("x") + [EOS]


def _status_error(fn):
    try:
        fn()
    except openai.APIStatusError as e:
        return e
    raise AssertionError("no error")


def test_bad_requests_get_openai_style_errors():
    ctx = ScriptedContext({"t0": ["a1", "b2"]})
    errors = {}

    def agent(client, prompt):
        llm = openai.OpenAI(**client, max_retries=0)
        c = llm.chat.completions
        errors["stream"] = _status_error(
            lambda: c.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
        )
        errors["n"] = _status_error(lambda: c.create(model="m", messages=[{"role": "user", "content": "x"}], n=2))
        errors["image"] = _status_error(
            lambda: c.create(
                model="m",
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
            )
        )
        errors["max_tokens"] = _status_error(lambda: llm.completions.create(model="m", prompt="x", max_tokens=0))
        key = {"Authorization": f"Bearer {client['api_key']}"}
        raw = httpx.post(client["base_url"] + "/chat/completions", content=b"{not json", headers=key, timeout=10)
        errors["json"] = (raw.status_code, raw.json())
        errors["path"] = httpx.get(client["base_url"] + "/embeddings", headers=key, timeout=10)
        errors["who"] = _status_error(
            lambda: openai.OpenAI(
                base_url=client["base_url"].replace("/c/", "/c/x"), api_key=client["api_key"], max_retries=0
            ).completions.create(model="m", prompt="x")
        )
        errors["nokey"] = httpx.post(
            client["base_url"] + "/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        errors["badkey"] = httpx.get(client["base_url"] + "/models", headers={"Authorization": "Bearer k"}, timeout=10)
        first = llm.completions.create(model="m", prompt=prompt).choices[0].text
        again = llm.completions.create(model="m", prompt=prompt).choices[0].text  # a retry: the same answer
        assert again == first
        errors["rewrite"] = _status_error(lambda: llm.completions.create(model="m", prompt=prompt + "zz"))
        llm.completions.create(model="m", prompt=prompt + first + "?")
        errors["max_calls"] = _status_error(lambda: llm.completions.create(model="m", prompt=prompt + first + "?b2+"))
        return first

    [traj] = group = _group(1)
    _run(OpenAIAgent(agent, max_calls=2), group, ctx)
    for key, words in [
        ("stream", "streaming is not supported"),
        ("n", "one choice per call"),
        ("image", "only text content"),
        ("max_tokens", "positive integer"),
        ("rewrite", "does not continue conversation"),
        ("max_calls", "max_calls=2"),
    ]:
        e = errors[key]
        assert isinstance(e, openai.BadRequestError) and words in e.message, (key, e.message)
        assert e.body["type"] == "invalid_request_error"
    assert "differ at character 5" in errors["rewrite"].message  # "a3b5=" then "a1" or "zz"
    assert isinstance(errors["who"], openai.AuthenticationError) and "another conversation" in errors["who"].message
    for key in ("nokey", "badkey"):  # nothing is answered without the key: 401, one line of JSON
        r = errors[key]
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (key, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and "\n" not in r.text
    status, body = errors["json"]
    assert status == 400 and body["error"]["message"] == "the request body is not valid JSON"
    assert errors["path"].status_code in (404, 405) and "error" in errors["path"].json()
    # the refused requests left no trace: two calls, one environment character
    assert traj.output_ids == ctx.encode("a1") + [EOS] + ctx.encode("?") + ctx.encode("b2") + [EOS]
    assert traj.reward_info["turns"] == 2


def test_agent_failures():
    def flaky(client, prompt):
        llm = openai.OpenAI(**client)
        text = llm.completions.create(model="m", prompt=prompt).choices[0].text
        if text == "bad":
            raise ValueError("cannot parse the model's answer")
        return text

    script = {"t0": ["ok"], "t1": ["bad"]}
    with pytest.raises(RuntimeError, match=r"the agent failed on t1 after 1 model calls.*cannot parse"):
        _run(OpenAIAgent(flaky), _group(2), ScriptedContext(script))
    ctx = ScriptedContext(script)
    results = _run(OpenAIAgent(flaky, on_agent_error="wrong"), _group(2), ctx)
    assert [r.correct for r in results] == [True, False] and "cannot parse" in results[1].reason
    assert ctx.graded == [["ok"]]  # only the answers the agent gave are graded
    # an answer without any model call has nothing to train: always an error
    with pytest.raises(RuntimeError, match="without a model call"):
        _run(OpenAIAgent(lambda client, prompt: "ok", on_agent_error="wrong"), _group(1), ScriptedContext(script))
    with pytest.raises(RuntimeError, match="not the answer's text"):
        _run(OpenAIAgent(lambda client, prompt: 3), _group(1), ScriptedContext(script))


def test_the_config_and_the_example_chain_agent():
    ep = make_episode(OpenAIAgentConfig(path="areal_core.episodes.examples:chain_agent", max_calls=3))
    assert isinstance(ep, OpenAIAgent) and ep.max_calls == 3
    with pytest.raises(ValueError, match=r"episode.path 'no.such:agent'"):
        make_episode(OpenAIAgentConfig(path="no.such:agent"))
    ctx = ScriptedContext({"t0": ["a3=3,b5=8|8", "8"], "t1": ["a3=3,b5=9|9", "9"]})
    group = _group(2)
    results = _run(ep, group, ctx)
    assert ctx.graded == [["a3=3,b5=8|8", "a3=3,b5=9|9"]] and [r.correct for r in results] == [False, False]
    assert [t.reward_info["turns"] for t in group] == [2, 2]
    assert group[0].output_mask == [1] * 9 + [0] + [1] * 2  # the "|" between the calls is the agent's


@pytest.mark.slow
def test_a_short_real_run_through_the_controller(tmp_path, warm_cache, shared_rewards):
    """The tiny model on the chain task with the example agent: embedded server, Dask grading, the
    trainer; every answer took two calls, with the agent's "|" masked, and the ledger holds."""
    import pandas as pd

    from areal_core.experiment import load_config
    from areal_core.run.setup import run_experiment

    cfg = load_config(
        "tests/data/e2e.yaml",
        {
            "episode": {"kind": "openai_agent", "path": "areal_core.episodes.examples:chain_agent"},
            "trainer.max_steps": 2,
            "rollout.sampling.max_new_tokens": 24,
            **shared_rewards,
        },
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    assert summary["steps"] == 2 and summary["ledger_check"]["ok"], summary["ledger_check"]
    m = pd.read_parquet(tmp_path / "run/metrics.parquet")
    assert (m["turns_mean"] == 2).all() and (m["environment_tokens"] > 0).all()


def test_calls_are_bounded_by_the_room_left_and_a_conversation_that_no_longer_fits_is_graded_wrong():
    """A trajectory may hold ``limit`` tokens (the context, the micro-batch, the KV budget): each call's
    max_tokens is what is left, and a call whose prompt leaves no room is refused (400
    context_length_exceeded) and ends the conversation; under on_agent_error 'wrong' it is graded wrong
    and the group's other answers are graded as usual."""
    limit = 24  # prompt "a3b5=" (5) + the first answer (5) + the agent's dots + the second answer

    def agent(client, prompt):
        llm = openai.OpenAI(**client, max_retries=0)
        first = llm.completions.create(model="m", prompt=prompt).choices[0].text
        dots = 2 if first.startswith("a") else 14  # t1's 14 leave no room: 5 + 5 + 14 = 24
        return llm.completions.create(model="m", prompt=prompt + first + "." * dots).choices[0].text

    ctx = ScriptedContext({"t0": ["aaaa", "ok"], "t1": ["bbbb", "ok"]}, limit=limit)
    group = _group(2)
    results = _run(OpenAIAgent(agent, on_agent_error="wrong"), group, ctx)
    assert results[0].correct and not results[1].correct, results
    assert "no longer fits" in results[1].reason and "24 tokens a trajectory may hold" in results[1].reason
    assert ctx.graded == [["ok"]]  # only t0's answer was graded
    for t in group:  # no trajectory ever holds more than the limit
        assert len(t.prompt_ids) + len(t.output_ids) <= limit, (t.traj_id, len(t.prompt_ids), len(t.output_ids))
    # every call asked for at most what was left: 24 - 5 = 19 at first; t0's second call 24 - 5 - 5 - 2 = 12
    assert sorted(ctx.max_new) == [12, 19, 19]
    assert group[1].output_ids == ctx.encode("bbbb") + [EOS]  # the dots that did not fit were not added
    # under on_agent_error 'raise', the agent's error (it got the 400) stops the episode, naming the cause
    ctx = ScriptedContext({"t0": ["aaaa", "ok"], "t1": ["bbbb", "ok"]}, limit=limit)
    with pytest.raises(RuntimeError, match="no longer fits"):
        _run(OpenAIAgent(agent), _group(2)[1:], ctx)


def test_a_request_the_rollout_server_refuses_ends_that_conversation_only():
    """A 400 from the rollout server (e.g. a prompt past its context) is the request's problem, not the
    run's: under on_agent_error 'wrong' that answer is graded wrong and the others go on."""
    ctx = ScriptedContext({"t0": ["a1", "ok"], "t1": ["b1", "ok"]}, refuse={"t1": 1})

    def agent(client, prompt):
        llm = openai.OpenAI(**client, max_retries=0)
        first = llm.completions.create(model="m", prompt=prompt).choices[0].text
        return llm.completions.create(model="m", prompt=prompt + first + "?").choices[0].text

    results = _run(OpenAIAgent(agent, on_agent_error="wrong"), _group(2), ctx)
    assert [r.correct for r in results] == [True, False]
    assert "refused the request" in results[1].reason and "context of 128" in results[1].reason


@pytest.mark.slow
@pytest.mark.nightly
def test_a_real_run_whose_conversations_outgrow_the_micro_batch_goes_on(tmp_path, warm_cache):
    """The example agent's second call repeats the first answer, so with a tight
    trainer.max_tokens_per_microbatch some conversations no longer fit: their calls are clamped to what
    is left or refused, those answers are graded wrong, and the run trains every step with no trajectory
    longer than the micro-batch (which would otherwise fail a training step)."""
    import pandas as pd

    from areal_core.experiment import load_config
    from areal_core.run.setup import run_experiment

    budget = 44
    cfg = load_config(
        "tests/data/e2e.yaml",
        {
            "episode": {
                "kind": "openai_agent",
                "path": "areal_core.episodes.examples:chain_agent",
                "on_agent_error": "wrong",
            },
            "trainer.max_steps": 2,
            "rollout.sampling.max_new_tokens": 24,
            "trainer.max_tokens_per_microbatch": budget,
        },
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    assert summary["steps"] == 2 and summary["ledger_check"]["ok"], summary["ledger_check"]
    ledger = pd.read_parquet(tmp_path / "run/ledger.parquet")
    assert len(ledger) == 2 * cfg.trainer.batch_size
    m = pd.read_parquet(tmp_path / "run/metrics.parquet")
    assert (m["answer_len_max"] <= budget).all() if "answer_len_max" in m else True
