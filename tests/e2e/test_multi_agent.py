"""Several agents in one run (areal_core/controller/agents.py): the routing table follows the top-k moving-average
rewards every M steps (ties by config order); only trainable-routed answers reach the trainer; the
frozen policy's server never gets weights; per-agent metrics; a state saved without agents loads."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from areal_core.controller import AgentSetup, ControllerSettings, Servers
from areal_core.controller.agents import FROZEN, TRAINABLE, AgentRouter, MultiAgentConfig, agent_prompter, rank_agents
from areal_core.controller.assemble import make_controller
from areal_core.controller.buffer import ReplayBuffer
from areal_core.experiment import ConfigError, load_config, parse_config
from areal_core.reward.result import RewardResult
from areal_core.rollout.backend import Sampling
from areal_core.run.metrics import RunLog, ledger_rows
from areal_core.types import Prompt, Trajectory
from tests.fake_servers import RecordingTransport, ScriptedServer

# --- the router: moving averages, the selection rule, the table ---------------------------------


def test_initial_table_is_the_first_top_k_in_config_order():
    r = AgentRouter(["a", "b", "c", "d"], top_k=2, every_steps=5, window=4)
    assert r.table() == {"a": TRAINABLE, "b": TRAINABLE, "c": FROZEN, "d": FROZEN}
    assert [r.agent_for(g) for g in range(6)] == ["a", "b", "c", "d", "a", "b"]  # round robin


def test_moving_average_is_over_the_last_window_rewards():
    r = AgentRouter(["a", "b"], top_k=1, every_steps=1, window=3)
    assert r.moving_average("a") is None
    for x in (5.0, 5.0, -5.0, -5.0):
        r.record("a", x, x > 0, TRAINABLE)
    assert r.moving_average("a") == pytest.approx(-5 / 3)  # the first 5.0 left the window
    r.record("b", 1.0, True, FROZEN)
    assert r.moving_average("b") == 1.0


def test_selection_takes_the_top_k_every_m_steps_only():
    r = AgentRouter(["a", "b", "c", "d"], top_k=2, every_steps=3, window=8)
    for agent, x in (("a", -5.0), ("b", 1.0), ("c", 5.0), ("d", 3.0)):
        r.record(agent, x, x > 0, r.route(agent))
    assert not any(r.maybe_select(s) for s in (0, 1, 2))  # not a multiple of every_steps
    assert r.table()["a"] == TRAINABLE
    assert r.maybe_select(3)
    assert r.table() == {"a": FROZEN, "b": FROZEN, "c": TRAINABLE, "d": TRAINABLE}
    assert r.selections[-1] == {
        "step": 3,
        "trainable": ["c", "d"],
        "averages": {"a": -5.0, "b": 1.0, "c": 5.0, "d": 3.0},
    }
    assert not r.maybe_select(3)  # once per step
    r.record("a", 5.0, True, FROZEN)  # a: mean (-5 + 5 + 5 + 5) / 4 = 2.5 > b's 1.0, < d's 3.0
    for _ in range(2):
        r.record("a", 5.0, True, FROZEN)
    assert not r.maybe_select(4) and not r.maybe_select(5)
    assert r.maybe_select(6) and r.selections[-1]["trainable"] == ["c", "d"]
    r.record("a", 5.0, True, FROZEN)  # (-5 + 4 * 5) / 5 = 3.0: ties d, and a comes first in the config
    assert r.maybe_select(9) and r.selections[-1]["trainable"] == ["c", "a"]


def test_ties_go_by_config_order_and_no_data_ranks_last():
    assert rank_agents(["x", "y", "z"], {"x": 1.0, "y": 1.0, "z": 1.0}) == ["x", "y", "z"]
    assert rank_agents(["x", "y", "z"], {"x": None, "y": -5.0, "z": None}) == ["y", "x", "z"]
    r = AgentRouter(["x", "y", "z"], top_k=1, every_steps=1, window=2)
    for a in ("z", "y", "x"):
        r.record(a, 0.0, False, r.route(a))
    assert r.select(1) == ["x"]  # all equal: the first in the config, whatever the order of rewards


def test_step_metrics_report_each_agent_and_reset():
    r = AgentRouter(["a", "b"], top_k=1, every_steps=1, window=10)
    r.record("a", 5.0, True, TRAINABLE)
    r.record("a", -5.0, False, TRAINABLE)
    r.record("b", 5.0, True, FROZEN)
    m = r.step_metrics()
    assert (m["agent_a_R"], m["agent_a_reward"], m["agent_a_accuracy"], m["agent_a_n"], m["agent_a_trainable"]) == (
        0.0,
        0.0,
        0.5,
        2,
        1,
    )
    assert (m["agent_b_R"], m["agent_b_n"], m["agent_b_trainable"]) == (5.0, 1, 0)
    again = r.step_metrics()  # nothing new since: no rewards, the averages stay
    assert again["agent_a_n"] == 0 and math.isnan(again["agent_a_reward"]) and again["agent_a_R"] == 0.0
    s = r.summary()["agents"]
    assert s["a"]["trainable"] == {"n": 2, "reward_mean": 0.0, "accuracy": 0.5}
    assert s["b"]["frozen"]["n"] == 1 and s["b"]["trainable"]["n"] == 0


def test_router_state_round_trips():
    r = AgentRouter(["a", "b", "c"], top_k=1, every_steps=2, window=3)
    for x in (1.0, 2.0, 3.0, 4.0):
        r.record("c", x, True, FROZEN)
    r.maybe_select(2)
    again = AgentRouter(["a", "b", "c"], top_k=1, every_steps=2, window=3)
    again.restore(r.state())
    assert again.table() == r.table() == {"a": FROZEN, "b": FROZEN, "c": TRAINABLE}
    assert again.moving_average("c") == 3.0 and again.selections == r.selections
    assert again.last_selection_step == 2 and not again.maybe_select(2)
    assert again.summary() == r.summary()


# --- config ----------------------------------------------------------------------------------------


def _ma(**kw):
    return {"agents": [{"id": "a"}, {"id": "b", "prefix": "> "}], "top_k": 1, **kw}


def test_multi_agent_is_off_by_default_and_typed():
    assert load_config("tests/data/e2e.yaml").multi_agent is None
    cfg = load_config("tests/data/e2e.yaml", {"multi_agent": _ma(every_steps=3)})
    assert cfg.multi_agent.every_steps == 3 and cfg.multi_agent.window == 256 and cfg.multi_agent.needs_frozen_server
    assert not MultiAgentConfig(agents=[{"id": "a"}], top_k=1).needs_frozen_server


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"agents": [{"id": "a"}, {"id": "a"}], "top_k": 1}, "unique"),
        (_ma(top_k=3), "exceeds the number of agents"),
        (_ma(top_k=0), "top_k"),
        ({"agents": [{"id": "a-b"}], "top_k": 1}, "id"),
        ({"agents": [], "top_k": 1}, "agents"),
    ],
)
def test_bad_multi_agent_configs_are_named(bad, says):
    with pytest.raises(ConfigError, match=says):
        load_config("tests/data/e2e.yaml", {"multi_agent": bad})


def test_frozen_policy_needs_an_embedded_server_and_v0_kept():
    with pytest.raises(ConfigError, match="embedded"):
        parse_config(
            {
                "multi_agent": _ma(),
                "rollout": {"backend": {"kind": "external", "urls": ["http://x:1"], "allow_unauthenticated": True}},
            }
        )
    with pytest.raises(ConfigError, match="keep_last"):
        parse_config({"multi_agent": _ma(), "storage": {"keep_last": 2}})
    # every agent trainable: no frozen server, so neither applies
    parse_config({"multi_agent": _ma(top_k=2), "storage": {"keep_last": 2}})


def test_agent_prompter_puts_the_prefix_before_the_prompt_text():
    from areal_core.data.datasets import to_prompts
    from areal_core.data.records import Record
    from areal_core.models import build_char_tokenizer

    tok = build_char_tokenizer()
    recs = [Record(id="r1", task="chain", prompt="a3b5=", solution="a3=3,b5=8|8")]
    (p,) = to_prompts(recs, tok)
    ids = agent_prompter(
        MultiAgentConfig(agents=[{"id": "plain"}, {"id": "q", "prefix": "Q:"}], top_k=1).agents, recs, tok
    )
    assert ids("plain", p) == p.input_ids
    assert tok.decode(ids("q", p)) == "Q:a3b5="


# --- the controller with scripted servers: routing, selective updates, no weights to frozen ---------

AGENT_TOKEN = {"good": 50, "bad": 51, "mid": 52}  # the prefix each agent puts before a prompt


class _ByAgent:
    """good: always right, bad: always wrong, mid: every other answer right (the echoed token says who)."""

    def __init__(self):
        self.n = 0

    def submit_batch(self, items, on_done):
        out = []
        for _, text, _, _ in items:
            self.n += 1
            ok = text == "good" or (text == "mid" and self.n % 2 == 0)
            out.append(RewardResult(correct=ok, parsed=text, reason="test"))
        on_done(out, None)


def _controller(agents: AgentRouter, servers: dict, transport, buffer, B=8, n=2, eta=1):
    names = {v: k for k, v in AGENT_TOKEN.items()}
    prompts = [Prompt(id=str(i), task="chain", input_ids=[5, 6, i], reference="r") for i in range(40)]
    settings = ControllerSettings(
        batch_size=B, eta=eta, n_samples=n, sampling=Sampling(max_new_tokens=4), reward_correct=5.0, reward_wrong=-5.0
    )

    def make_client(url, timeout_s=0):
        servers[url] = ScriptedServer(url)
        return servers[url]

    return make_controller(
        Servers(["http://trainable:1"], make_client=make_client),
        prompts,
        lambda ids: names.get(ids[0], "?"),
        _ByAgent(),
        buffer,
        settings,
        transport,
        version=0,
        agents=AgentSetup(
            agents,
            lambda a, p: [AGENT_TOKEN[a], *p.input_ids],
            Servers(["http://frozen:1"], model_path="/v0", make_client=make_client),
        ),
    )


def test_only_trainable_routed_answers_reach_the_trainer_and_the_frozen_server_gets_no_weights():
    # "bad" is first in the config, so it starts on the trainable policy; the selection at step 3
    # moves the trainable slot to "good" (highest moving average)
    agents = AgentRouter(["bad", "good", "mid"], top_k=1, every_steps=3, window=16)
    servers, transport, buffer = {}, RecordingTransport(), ReplayBuffer()
    c = _controller(agents, servers, transport, buffer)
    c.start()
    batches, tables = [], []
    try:
        for v in range(12):
            batches.append(buffer.take(8, version=v, eta=1, timeout=30))  # the trainer's input
            transport.stage(None, v + 1)
            c.update_weights(v + 1).result(timeout=30)
            tables.append(agents.table())
        metrics = c.agent_metrics()
        snap = c.snapshot()
    finally:
        c.stop()
    trained = [t for b in batches for t in b]
    # selective updates: every trained answer was routed to the trainable policy, none to the frozen one
    assert all(t.route == TRAINABLE and t.agent_id for t in trained)
    # before the first selection: only "bad" trains; once in-flight groups drained, only "good"
    assert {t.agent_id for t in batches[0]} == {"bad"}
    assert {t.agent_id for t in trained[-16:]} == {"good"}
    assert tables[2] == {"bad": FROZEN, "good": TRAINABLE, "mid": FROZEN}  # selected at step 3
    assert agents.selections[0]["trainable"] == ["good"]
    # the frozen server generated (the other agents' answers, in their style), and never got weights
    frozen = servers["http://frozen:1"]
    assert frozen.prompts and frozen.version == 0 and servers["http://trainable:1"].version == 12
    assert {p[0] for p in frozen.prompts} == {AGENT_TOKEN["good"], AGENT_TOKEN["mid"], AGENT_TOKEN["bad"]}
    assert transport.connected == ["http://trainable:1"]
    assert all(urls == ["http://trainable:1"] for urls in transport.pushed_to) and len(transport.pushed_to) == 12
    # frozen answers were recorded for their agents and counted, never buffered (the gate counts trainable only)
    assert c.frozen_generated > 0 and agents.summary()["agents"]["mid"]["frozen"]["n"] > 0
    assert agents.summary()["agents"]["mid"]["trainable"]["n"] == 0
    assert snap["n_submitted"] == sum(g["size"] for g in snap["groups"]) + len(trained)
    assert all(t["route"] == TRAINABLE for g in snap["groups"] for t in g["trajectories"])
    assert metrics["agent_good_trainable"] == 1 and metrics["agent_bad_trainable"] == 0
    assert metrics["agent_good_R"] == 5.0 and metrics["agent_bad_R"] == -5.0
    assert snap["agents"]["trainable"] == ["good"]
    # each trained answer carries its behaviour version (the servers' version when sampled)
    assert all(t.policy_version == t.output_versions[0] for t in trained)


def test_a_state_saved_without_agents_restores_with_the_initial_table():
    agents = AgentRouter(["bad", "good"], top_k=1, every_steps=3, window=16)
    c = _controller(agents, {}, RecordingTransport(), ReplayBuffer())
    old_row = {
        "traj_id": "e0-p1-s0",
        "group_id": "e0-p1",
        "seq_no": 0,
        "admit_version": 0,
        "prompt_ids": [5, 6, 1],
        "output_ids": [1, 3],
        "output_logprobs": [-1.0, -1.0],
        "output_versions": [0, 0],
        "finish_reason": "stop",
        "reward": 5.0,
        "correct": True,
    }  # a row from before agent_id & co
    c.restore(
        {
            "n_submitted": 2,
            "n_groups": 1,
            "version": 0,
            "groups": [
                {"group_id": "e0-p1", "first_seq_no": 0, "admit_version": 0, "size": 2, "trajectories": [old_row]}
            ],
        }
    )
    assert agents.table() == {"bad": TRAINABLE, "good": FROZEN}
    t = Trajectory.from_row(old_row)
    assert (t.agent_id, t.route, t.policy_version) == ("", "", None)


def test_an_old_ledger_resumes_and_new_rows_carry_agent_and_versions(tmp_path):
    import io

    old = pd.DataFrame(
        [
            {
                "trajectory_id": "e0-p1-s0",
                "step": 1,
                "trained_by_version": 0,
                "admit_version": 0,
                "min_token_version": 0,
                "max_token_version": 0,
                "n_tokens": 2,
                "reward": 1.0,
            }
        ]
    )
    buf = io.BytesIO()
    old.to_parquet(buf, index=False)
    log = RunLog(tmp_path)
    log.restore(pd.DataFrame([{"step": 1}]).to_parquet(index=False), buf.getvalue())
    t = Trajectory(
        traj_id="e0-p2-s0",
        group_id="e0-p2",
        seq_no=2,
        admit_version=1,
        prompt_ids=[1],
        output_ids=[4, 5],
        output_logprobs=[0.0, 0.0],
        output_versions=[1, 2],
        reward=5.0,
        agent_id="good",
    )
    log.log_step({"step": 2}, ledger_rows([t], 2, 2, prox_version=2))
    led = pd.read_parquet(tmp_path / "ledger.parquet")
    assert list(led["agent_id"]) == ["", "good"]
    assert list(led["policy_version"]) == [0, 1] and led["prox_version"].iloc[1] == 2


# --- a real short run: embedded servers (one frozen), Dask grading, the trainer; crash and resume ----


class _Crash(Exception):
    pass


@pytest.mark.slow
@pytest.mark.nightly
def test_multi_agent_run_end_to_end_and_resumed(tmp_path, monkeypatch, warm_cache):
    from areal_core.run.setup import run_experiment
    from areal_core.trainer.trainer import Trainer

    seen: list[Trajectory] = []
    real_step = Trainer.step

    def step(self, batch, version):  # the trainer's input
        seen.extend(batch)
        return real_step(self, batch, version)

    def crash(row):
        if row["step"] == 2:
            raise _Crash("stop after step 2")

    monkeypatch.setattr(Trainer, "step", step)
    agents = [{"id": "x", "prefix": "a9="}, {"id": "plain"}, {"id": "q", "prefix": "> "}]
    cfg = load_config(
        "tests/data/e2e.yaml",
        {
            "trainer.max_steps": 4,
            "rollout.sampling.max_new_tokens": 24,
            "storage.checkpoint_every": 2,
            "multi_agent": {"agents": agents, "top_k": 1, "every_steps": 2, "window": 32},
        },
    )
    run, cache = tmp_path / "run", warm_cache
    with pytest.raises(_Crash):
        run_experiment(cfg, run, progress=False, cache_dir=cache, on_step=crash)
    s = run_experiment(cfg, run, progress=False, cache_dir=cache, resume=True)
    assert s["resumed_from_step"] == 2 and s["ledger_check"]["ok"], s["ledger_check"]
    ma = s["multi_agent"]
    assert ma["frozen_server_versions"] == [0] and s["final_version"] == 4  # the frozen server never moved
    # the selection of step 2 came back with the resume state, the one of step 4 followed
    assert [sel["step"] for sel in ma["selections"]] == [2, 4]
    assert seen and all(t.route == TRAINABLE for t in seen)  # selective updates, at the trainer's input
    ledger = pd.read_parquet(run / "ledger.parquet")
    assert len(ledger) == 4 * 16 and set(ledger["agent_id"]) <= {"x", "plain", "q"}
    assert (ledger["prox_version"] == ledger["trained_by_version"]).all()
    assert set(ledger["trajectory_id"]) <= {t.traj_id for t in seen}
    m = pd.read_parquet(run / "metrics.parquet")
    assert list(m["step"]) == [1, 2, 3, 4]
    # frozen answers were graded and recorded: counted per process, so in the crashed run (steps 1-2) or the
    # resumed one (on a loaded machine the frozen server's first answers can come after a 2-step run's end)
    assert max(m.loc[m["step"] <= 2, "frozen_answers"].max(), ma["frozen_answers"]) > 0
    for a in ("x", "plain", "q"):
        assert {f"agent_{a}_R", f"agent_{a}_n", f"agent_{a}_trainable", f"agent_{a}_trained"} <= set(m.columns)
    assert (m[[f"agent_{a}_trainable" for a in ("x", "plain", "q")]].sum(axis=1) == 1).all()  # top_k 1
    assert (m[[f"agent_{a}_trained" for a in ("x", "plain", "q")]].sum(axis=1) == 16).all()
