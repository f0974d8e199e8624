"""The tool-use episode (areal_core/episodes/tool.py): on a scripted policy, a call really runs in the
sandbox and its output comes back as masked environment text; max_calls, the time limit and the
output cut hold; hostile calls cannot reach the host or spoil each other's output. Then a short real
run (embedded servers, Dask grading, the trainer) with the tool."""

import asyncio
import os
import time

import pandas as pd
import pytest

from areal_core.data.config import SyntheticTask
from areal_core.data.synthetic import TOOL_CLOSE, TOOL_OPEN, TOOL_RESULT, ChainTask, grade_chain, make_solution
from areal_core.episodes import make_episode
from areal_core.episodes.config import ToolConfig
from areal_core.episodes.tool import CallResult, PythonTool, ToolUse
from areal_core.reward.result import RewardResult
from areal_core.reward.sandbox import guarantees
from areal_core.types import Trajectory

EOS = 0


class ScriptedPolicy:
    """A policy that writes a fixed text per trajectory, as the engine would: a turn goes on until a
    stop token (kept in the answer), EOS at the end of the text, or its token budget. Text is one
    token per character (``ord``); the graded answer is right when it equals ``want``."""

    version = 7

    def __init__(self, texts: dict[str, str], want: dict[str, str] | None = None, limit: int | None = None):
        self.texts, self.want = texts, want or {}
        self.limit = limit  # tokens a trajectory may hold (None: no limit)
        self.pos = dict.fromkeys(texts, 0)
        self.graded: list[list[str]] = []
        self.requests: list[tuple[str, tuple[int, ...]]] = []

    async def generate(self, trajs, max_new_tokens=None, stop_token_ids=()):
        for t in trajs:
            self.requests.append((t.traj_id, tuple(stop_token_ids)))
            text, ids = self.texts[t.traj_id], []
            t.finish_reason = "length"
            while max_new_tokens is None or len(ids) < max_new_tokens:
                k = self.pos[t.traj_id]
                if k >= len(text):
                    ids.append(EOS)
                    t.finish_reason = "stop"
                    break
                ids.append(ord(text[k]))
                self.pos[t.traj_id] = k + 1
                if ids[-1] in stop_token_ids:
                    t.finish_reason = "stop"
                    break
            if t.output_mask:
                t.output_mask += [1] * len(ids)
            t.output_ids += ids
            t.output_logprobs += [-0.25] * len(ids)
            t.output_versions += [self.version] * len(ids)

    async def grade(self, trajs, texts):
        self.graded.append(list(texts))
        return [RewardResult(correct=x == self.want.get(t.traj_id), parsed=x, reason="") for t, x in zip(trajs, texts)]

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != EOS)

    def room(self, traj):
        return None if self.limit is None else self.limit - len(traj.prompt_ids) - len(traj.output_ids)


def _group(n):
    return [Trajectory(traj_id=f"t{i}", group_id="g", seq_no=i, admit_version=7, prompt_ids=[5, 6]) for i in range(n)]


def _env_text(t, ctx):
    return ctx.decode([i for i, m in zip(t.output_ids, t.output_mask) if m == 0])


def _policy_text(t, ctx):
    mask = t.output_mask or [1] * len(t.output_ids)
    return ctx.decode([i for i, m in zip(t.output_ids, mask) if m == 1])


def test_a_call_runs_in_the_sandbox_and_its_output_is_masked_environment_text():
    # 10**12 + 7 mod 97 is not in the policy's text: only running the call gives it
    ctx = ScriptedPolicy(
        {"t0": "<py>(10**12 + 7) % 97</py>|ok", "t1": "a3=3,b4=7|7"},
        want={"t0": f"<py>(10**12 + 7) % 97</py><out>{(10**12 + 7) % 97}</out>|ok"},
    )
    group = _group(2)
    tool = PythonTool(timeout_s=2.0)
    results = asyncio.run(ToolUse(max_calls=2, tool=tool).run(group, ctx))
    t0, t1 = group
    assert results[0].correct, ctx.graded
    out = f"<out>{(10**12 + 7) % 97}</out>"
    assert _env_text(t0, ctx) == out and tool.n_sandbox_runs == 1
    # the policy's tokens are 1, the tool's output 0; one logprob and one version per token
    assert _policy_text(t0, ctx) == "<py>(10**12 + 7) % 97</py>|ok"
    n_call = len("<py>(10**12 + 7) % 97</py>")
    assert t0.output_mask == [1] * n_call + [0] * len(out) + [1] * (len("|ok") + 1)
    assert len(t0.output_logprobs) == len(t0.output_versions) == len(t0.output_ids)
    assert all(lp == 0.0 for lp, m in zip(t0.output_logprobs, t0.output_mask) if m == 0)
    # the whole answer is graded, once, with the output in it
    assert ctx.graded == [[f"<py>(10**12 + 7) % 97</py>{out}|ok", "a3=3,b4=7|7"]]
    assert (t0.reward_info["tool_calls"], t0.reward_info["turns"]) == (1, 2)
    assert (t1.reward_info["tool_calls"], t1.output_mask) == (0, [])  # no call: a single-turn answer
    # the turn stopped at the '>' of the opening tag, then went on to the closing one
    assert [r for r in ctx.requests if r[0] == "t0"][:2] == [("t0", (ord(">"),)), ("t0", (ord(">"),))]


def test_a_tool_output_that_does_not_fit_ends_the_answer():
    """A trajectory may hold 30 tokens (prompt 2): t0's call (15 tokens) leaves 13, too few for its output
    "<out>100000000000000000000</out>" (32) and an answer, so the output is not added and the answer ends
    there, graded as it is; t1's call (10) and its output (12) leave room for "|y"."""
    ctx = ScriptedPolicy({"t0": "<py>10**20</py>|x", "t1": "<py>1</py>|y"}, limit=30)
    group = _group(2)
    asyncio.run(ToolUse(max_calls=2, tool=PythonTool()).run(group, ctx))
    t0, _t1 = group
    assert ctx.decode(t0.output_ids) == "<py>10**20</py>" and t0.finish_reason == "length"
    assert ctx.graded == [["<py>10**20</py>", "<py>1</py><out>1</out>|y"]]
    assert all(len(t.prompt_ids) + len(t.output_ids) <= 30 for t in group)


def test_max_calls_then_plain_text():
    text = "<py>1+1</py>,<py>2+2</py>,<py>3+3</py>|x"
    ctx = ScriptedPolicy({"t0": text})
    group = _group(1)
    asyncio.run(ToolUse(max_calls=2, tool=PythonTool()).run(group, ctx))
    t = group[0]
    assert _env_text(t, ctx) == "<out>2</out><out>4</out>"  # the third call was not run
    assert ctx.decode(t.output_ids) == "<py>1+1</py><out>2</out>,<py>2+2</py><out>4</out>,<py>3+3</py>|x"
    assert t.reward_info["tool_calls"] == 2
    assert ctx.requests[-1] == ("t0", ())  # the turn after the last call has no stop
    # max_calls 0: the plain single-turn episode, no stop tokens at all
    ctx = ScriptedPolicy({"t0": text})
    group = _group(1)
    asyncio.run(ToolUse(max_calls=0, tool=PythonTool()).run(group, ctx))
    assert group[0].output_mask == [] and ctx.requests == [("t0", ())]


def test_timeout_and_output_cut():
    # 3 s: the calls that end must end within it on a loaded machine (at 0.5 s, printing the
    # million characters ran past it beside a training run); the calls run side by side
    tool = PythonTool(timeout_s=3.0, max_output_chars=10)
    t0 = time.perf_counter()
    spin, sleep, loud, err, ok = tool.run(
        ["while True: pass", "import time; time.sleep(30)", "print('y' * 10**6)", "1/0", "x = 6\nx * 7"]
    )
    assert time.perf_counter() - t0 < 20  # not the 30 s sleep
    assert spin.timed_out and sleep.timed_out and "ran past 3s" in spin.output
    assert loud.truncated and loud.output == "y" * 10 + "..."
    assert err.output == "ZeroDivisi..."  # "ZeroDivisionError: division by zero", cut to 10 characters
    assert ok == CallResult("42")


def test_turn_budget_caps_each_turn():
    ctx = ScriptedPolicy({"t0": "<py>" + "1+" * 40 + "1</py>|z"})
    group = _group(1)
    asyncio.run(ToolUse(max_calls=1, max_new_tokens_per_turn=20, tool=PythonTool()).run(group, ctx))
    t = group[0]
    assert len(t.output_ids) == 20 and t.finish_reason == "length" and t.reward_info["tool_calls"] == 0


class _RecordingTool:
    def __init__(self):
        self.batches = []

    def run(self, codes):
        self.batches.append(list(codes))
        return [CallResult(f"r{len(c)}") for c in codes]


def test_calls_of_a_group_go_to_the_tool_together_and_a_close_without_open_is_no_call():
    ctx = ScriptedPolicy({"t0": "<py>1</py>|a", "t1": "<py>22</py>|b", "t2": "x</py>|c"})
    tool = _RecordingTool()
    group = _group(3)
    asyncio.run(ToolUse(max_calls=1, tool=tool).run(group, ctx))
    assert tool.batches == [["1", "22"]]
    assert ctx.decode(group[2].output_ids) == "x</py>" and group[2].reward_info["tool_calls"] == 0


def test_hostile_calls_cannot_hurt_the_host_or_each_other(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_TOOL_TEST_SECRET", "s3cr3t-value")
    target = tmp_path / "pwned.txt"
    g = guarantees()
    hostile = [
        f"open({str(target)!r}, 'w').write('pwned')",  # write a host file
        "import os; os.environ.get('AREAL_TOOL_TEST_SECRET')",  # read the host's environment
        "import os; os.kill(os.getppid(), 9)",  # kill its parent (a batch's zygote, root's: out of reach)
        "import os; [os.fork() for _ in range(64)]",  # fork bomb: the sandbox's process limit
        "bytearray(4 * 2**30)",  # memory: the address-space limit
        "import os; fd = os.open('/proc/%d/fd/1' % os.getppid(), os.O_WRONLY); os.write(fd, b'[]')",
        "import os; os._exit(126)",  # the exit code of a failed setup: the batch goes on
        "3 + 4",
    ]
    if g["own_user"]:  # signalling the host is refused only where the sandbox has a user id of its own
        hostile.append(f"import os; os.kill({os.getpid()}, 9)")
    ctx = ScriptedPolicy({f"t{i}": f"<py>{c}</py>|" for i, c in enumerate(hostile)})
    group = _group(len(hostile))
    tool = PythonTool(timeout_s=2.0, max_output_chars=200)
    asyncio.run(ToolUse(max_calls=1, timeout_s=2.0, tool=tool).run(group, ctx))
    # one sandbox run for all (each call under a user id of its own) where the sandbox has user ids to give
    assert tool.n_sandbox_runs == (1 if g["own_user"] else len(hostile))
    outs = {c: _env_text(t, ctx) for c, t in zip(hostile, group)}
    assert not target.exists() or target.read_text() == ""  # no call writes a file (RLIMIT_FSIZE 0)
    if g["writes_confined"]:
        assert not target.exists()
    assert all("s3cr3t" not in o for o in outs.values())  # the scrubbed environment
    assert outs["bytearray(4 * 2**30)"].startswith("<out>MemoryError")
    assert outs["3 + 4"] == "<out>7</out>"  # the neighbours of hostile calls get their own output
    assert os.getppid() > 0  # and we are alive
    for t in group:
        assert len(t.output_mask) == len(t.output_ids) and t.reward_info["tool_calls"] == 1


def test_config_and_the_chain_task_tool_format():
    ep = make_episode(ToolConfig(max_calls=3, timeout_s=1.5, max_output_chars=16))
    assert isinstance(ep, ToolUse) and ep.max_calls == 3 and ep.tool.timeout_s == 1.5
    d = ToolConfig()
    assert (d.open_tag, d.close_tag, d.result_template) == (TOOL_OPEN, TOOL_CLOSE, TOOL_RESULT)
    with pytest.raises(ValueError):
        ToolConfig(result_template="no placeholder")
    with pytest.raises(ValueError):
        SyntheticTask(format="tool")  # needs tool_min_chain
    with pytest.raises(ValueError):
        SyntheticTask(tool_min_chain=5)  # only with format tool
    # the tool format: long chains as a call, its output and the answer; short ones explicit
    digits = [3, 5, 7, 2, 9, 1]
    assert make_solution(digits, "tool", 6) == "<py>sum(map(int,'a3b5c7d2e9f1'[1::2]))</py><out>27</out>|27"
    assert make_solution(digits, "tool", 7) == make_solution(digits) == "a3=3,b5=8,c7=15,d2=17,e9=26,f1=27|27"
    assert grade_chain("<py>sum(map(int,'a3b5c7d2e9f1'[1::2]))</py><out>27</out>|27", make_solution(digits, "tool", 6))[
        0
    ]
    # the default task's records do not change
    base = ChainTask(SyntheticTask(n_train=300, n_eval=50)).train_records()
    tool = ChainTask(SyntheticTask(n_train=300, n_eval=50, format="tool", tool_min_chain=6)).train_records()
    assert [r.prompt for r in base] == [r.prompt for r in tool]
    for b, t in zip(base, tool):
        assert t.solution == (
            b.solution if b.meta["k"] < 6 else make_solution([int(c) for c in b.prompt[1::2]], "tool", 6)
        )


def test_heldout_with_tools_command(tmp_path, capsys):
    """``areal-flow eval-tools RUN_DIR``: the held-out evaluation with tools; a folder that is not a run
    is named before anything starts."""
    from flows.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval-tools", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "RUN_DIR" in out and "--n-problems" in out and "--version" in out
    assert main(["eval-tools", str(tmp_path)]) == 2
    assert f"not a run folder (no config.json): {tmp_path}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.nightly
def test_tool_episode_runs_end_to_end(tmp_path, warm_cache):
    from areal_core.experiment import load_config
    from areal_core.run.setup import run_experiment

    cfg = load_config(
        "tests/data/e2e.yaml",
        {
            "data.synthetic": {
                "n_train": 500,
                "n_eval": 200,
                "min_chain": 2,
                "max_chain": 6,
                "format": "tool",
                "tool_min_chain": 2,
            },
            "model.warm_start": {"steps": 150, "batch_size": 32, "lr": 0.003},
            "episode": {"kind": "tool", "max_calls": 1, "timeout_s": 1.0},
            "trainer.max_steps": 3,
            "rollout.sampling.max_new_tokens": 32,
            "eval.n_problems": 16,
        },
    )
    summary = run_experiment(cfg, tmp_path / "run", progress=False, cache_dir=warm_cache)
    assert summary["steps"] == 3 and summary["ledger_check"]["ok"], summary["ledger_check"]
    m = pd.read_parquet(tmp_path / "run/metrics.parquet")
    # the warm-started policy writes calls: they ran, and their outputs came back as masked text
    assert (m["environment_tokens"] > 0).any() and (m["turns_mean"] > 1).any()
    assert (m["turns_mean"] <= 2).all()
