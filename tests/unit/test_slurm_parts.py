"""The Slurm pieces that need no cluster: ``cluster:`` in the config, the batch scripts each pool's
jobs run, what ``scontrol`` says parsed into job states, the run's job list, and the join list's
turns between writers. (tests/e2e/test_slurm_pools.py and test_slurm_run.py run them on a cluster.)"""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.jobs import RunJobs
from areal_core.cluster.pools import weight_transport, with_run_folder
from areal_core.cluster.reward_pool import jobqueue_options
from areal_core.cluster.rollout_pool import SlurmRolloutBackend
from areal_core.cluster.scripts import sbatch_options
from areal_core.cluster.slurm import JobInfo, parse_jobs
from areal_core.cluster.trainer_job import TrainerJobEnded, outcome, set_args, trainer_command, trainer_script
from areal_core.experiment import ConfigError, load_config, parse_overrides
from areal_core.reward.config import RewardConfig
from areal_core.rollout.config import EngineConfig
from areal_core.rollout.join_list import announce, read_urls
from areal_core.run.listing import describe

E2E = Path(__file__).resolve().parents[1] / "data/e2e.yaml"
SLURM = {"kind": "slurm", "partition": "gpu", "account": "rl", "time_limit": "2-00:00:00"}


def test_a_slurm_cluster_makes_the_pool_elastic_and_its_weights_travel_by_broadcast():
    cfg = load_config(E2E, {"cluster": SLURM})
    assert cfg.cluster.kind == "slurm" and cfg.cluster.partition == "gpu"
    assert cfg.rollout.weight_transport.kind == "distributed" and cfg.rollout.min_servers == 1
    local = load_config(E2E)
    assert local.cluster.kind == "local" and local.rollout.weight_transport is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"cluster.time_limit": "1 day"}, r"cluster\.slurm\.time_limit: .*sbatch's --time format"),
        ({"cluster.rollout": {"memory": "lots"}}, r"cluster\.slurm\.rollout\.memory: .*sbatch --mem"),
        ({"cluster.extra_sbatch": ["#SBATCH --qos=x"]}, r"one sbatch option as it follows '#SBATCH'"),
        ({"cluster.kind": "pbs"}, r"cluster: .*'local', 'slurm'"),
        ({"rollout.weight_transport": {"kind": "tensor"}}, r"'tensor' shares memory on one host"),
        (
            {"rollout.backend": {"kind": "external", "urls": ["http://h:1"], "allow_unauthenticated": True}},
            r"rollout\.backend\.kind must be embedded",
        ),
    ],
)
def test_bad_cluster_settings_name_the_key_and_what_was_expected(change, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        load_config(E2E, {"cluster": dict(SLURM), **change})
    assert "--set" in str(e.value) or str(E2E) in str(e.value)


def test_each_pools_sbatch_lines_come_from_the_cluster_and_the_pool():
    c = SlurmClusterConfig(
        **SLURM,
        extra_sbatch=["--qos=high"],
        rollout={"cpus_per_task": 4, "gpus_per_node": 1, "memory": "32G", "extra_sbatch": ["--constraint=a100"]},
    )
    opts = sbatch_options(c, c.rollout, job_name="af-x-rollout", log="/r/rollout-%A_%a.log", array="0-3")
    assert opts == [
        "--job-name=af-x-rollout",
        "--output=/r/rollout-%A_%a.log",
        "--open-mode=append",
        "--array=0-3",
        "--partition=gpu",
        "--account=rl",
        "--time=2-00:00:00",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--gpus-per-node=1",
        "--mem=32G",
        "--requeue",
        "--qos=high",
        "--constraint=a100",
    ]


def test_the_rollout_array_script_runs_rollout_server_and_holds_no_key(tmp_path):
    c = SlurmClusterConfig(
        setup=["module load cuda", "source /shared/venv/bin/activate"], python="/shared/venv/bin/python"
    )
    b = SlurmRolloutBackend(
        n_servers=3,
        cluster=c,
        engine=EngineConfig(max_running=32),
        run_dir=str(tmp_path),
        run_name="x",
        api_key="the-secret",
        join_from=str(tmp_path / "join.txt"),
        trainer_address="10.0.0.1",
        seed=5,
    )
    script = b.script("/store/v0", 0)
    assert "the-secret" not in script
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "#SBATCH --array=0-2" in lines
    assert lines.index("module load cuda") < lines.index("source /shared/venv/bin/activate") < len(lines) - 1
    command = lines[-1]
    assert command.startswith("exec /shared/venv/bin/areal-flow rollout-server --model-path /store/v0")
    assert "--host-towards 10.0.0.1 --port 0 --announce" in command and "${SLURM_ARRAY_TASK_ID}.json" in command
    seeds = {json.loads((tmp_path / f"slurm/rollout-engine-{k}.json").read_text())["seed"] for k in range(3)}
    assert len(seeds) == 3  # each server samples with a seed of its own


def test_the_trainer_job_resumes_with_the_same_config_and_overrides(tmp_path):
    c = SlurmClusterConfig(**SLURM, trainer={"nodes": 2, "tasks_per_node": 8, "gpus_per_node": 8})
    sets = set_args({"trainer.eta": 4, "reward.scheduler_address": None, "cluster.rollout": {"nodes": 1}})
    assert parse_overrides(sets) == {
        "trainer.eta": 4,
        "reward.scheduler_address": None,
        "cluster.rollout": {"nodes": 1},
    }
    script = trainer_script(c, "q", trainer_command(c, str(E2E), str(tmp_path), sets, 40), str(tmp_path))
    assert "srun" not in script  # one process: the job's command, once
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script and "#SBATCH --requeue" in script
    command = script.splitlines()[-1]
    assert f"train {E2E} --run-dir {tmp_path} --resume --no-prefect --no-progress" in command
    assert "--set trainer.eta=4" in command and "--set cluster.kind=slurm" in command
    assert command.endswith("--max-steps 40")


def test_a_megatron_trainer_of_several_ranks_runs_one_per_task_with_the_rendezvous_on_its_first_node(tmp_path):
    c = SlurmClusterConfig(**SLURM, trainer={"nodes": 2, "tasks_per_node": 2})
    command = trainer_command(c, str(E2E), str(tmp_path), [], 10)
    script = trainer_script(c, "q", command, str(tmp_path), ranks=4, controller="10.1.2.3")
    lines = script.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=2" in lines
    addr = next(line for line in lines if line.startswith("MASTER_ADDR=$("))
    assert '"10.1.2.3", 6817' in addr  # this node's address on the route to the controller
    assert lines[-2] == "export MASTER_ADDR MASTER_PORT"  # (then the launcher)
    last = shlex.split(lines[-1])
    assert last[:4] == ["exec", "srun", "--kill-on-bad-exit=0", "bash"]
    assert "RANK=$SLURM_PROCID" in last[5] and "WORLD_SIZE=$SLURM_NTASKS" in last[5] and "LOCAL_WORLD_SIZE=2" in last[5]
    assert last[7:] == command  # each task execs the same areal-flow train, with its rank in the environment
    # the rank environment as bash makes it, for a task Slurm numbered 3 (local 1) of 4
    env = {**os.environ, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4"}
    probe = [*last[3:7], "sh", "-c", "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.split() == ["3", "1", "4", "2"]


@pytest.mark.parametrize(
    ("job", "processes", "expected"),
    [
        ({"nodes": 2}, 4, 2),
        ({"nodes": 3, "tasks_per_node": 1}, 3, 1),
        ({"nodes": 2}, 3, None),
        ({"nodes": 2, "tasks_per_node": 1}, 4, None),
    ],
)
def test_a_megatron_trainers_ranks_fill_its_jobs_nodes(job, processes, expected):
    overrides = {
        "trainer.backend": {"kind": "megatron", "processes": processes},
        "cluster": {**SLURM, "trainer": job},
    }
    if expected is None:
        with pytest.raises(ConfigError, match=r"nodes x tasks_per_node .* must equal trainer.backend.processes"):
            load_config(E2E, overrides)
    else:
        assert load_config(E2E, overrides).cluster.trainer.tasks_per_node == expected


def test_gloo_listens_on_the_interface_towards_the_master(monkeypatch):
    from areal_core.net import address_towards, interface_of

    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.77") is None
    parallel = pytest.importorskip("areal_core.trainer.megatron.parallel")
    # (set, then removed: the variable the code sets below is removed again after the test, not
    # left to the other tests of this process)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert parallel.gloo_interface_towards_master() is None and "GLOO_SOCKET_IFNAME" not in os.environ
    here = address_towards("192.0.2.1", 9)  # (TEST-NET-1: only the route is asked for)
    monkeypatch.setenv("MASTER_ADDR", here)
    assert parallel.gloo_interface_towards_master() == interface_of(here) == os.environ["GLOO_SOCKET_IFNAME"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice is kept
    assert parallel.gloo_interface_towards_master() is None and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


SCONTROL = (
    "JobId=12 ArrayJobId=12 ArrayTaskId=0 JobName=af-x-rollout JobState=RUNNING Reason=None Dependency=(null) "
    "Restarts=1 ExitCode=0:0 NodeList=n2 BatchHost=n2 StdOut=/r/slurm/rollout-12_0.log\n"
    "JobId=14 ArrayJobId=12 ArrayTaskId=1-3 JobState=PENDING Reason=Resources NodeList=(null) "
    "StdOut=/r/slurm/rollout-12_4294967294.log\n"
    "JobId=20 JobName=af-x-trainer JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0 NodeList=n1 "
    "StdOut=/r/slurm/trainer-20.log\n"
)


def test_scontrol_lines_become_job_states_that_say_what_and_where():
    running, pending, failed = parse_jobs(SCONTROL)
    assert (running.job_id, running.state, running.node, running.restarts) == ("12_0", "RUNNING", "n2", 1)
    assert running.describe() == "job 12_0 RUNNING on n2" and not running.ended
    assert pending.describe() == "job 12_1-3 PENDING (Resources)" and pending.node == ""
    assert failed.describe() == "job 20 FAILED (exit 1:0) on n1" and failed.ended
    assert failed.log == "/r/slurm/trainer-20.log"


def test_a_trainer_job_ends_as_its_run_did(tmp_path):
    done = JobInfo("20", "COMPLETED", "None", "n1", "/r/t.log", "0:0", 0)
    with pytest.raises(TrainerJobEnded, match=r"summary\.json was not written"):
        outcome(done, tmp_path, "again")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    assert outcome(done, tmp_path, "again") == {"steps": 3}
    stopped = JobInfo("20", "FAILED", "NonZeroExitCode", "n1", "/r/t.log", "130:0", 0)
    with pytest.raises(TrainerJobEnded, match=r"stopped; continue with areal-flow train c --resume") as e:
        outcome(stopped, tmp_path, "areal-flow train c")
    assert e.value.stopped
    log = tmp_path / "t.log"
    log.write_text("step 1\nRuntimeError: out of memory\n")
    failed = JobInfo("20", "FAILED", "NonZeroExitCode", "n1", str(log), "1:0", 0)
    with pytest.raises(
        TrainerJobEnded, match=r"job 20 FAILED \(exit 1:0\) on n1; .*last line: RuntimeError: out of memory"
    ):
        outcome(failed, tmp_path, "again")


def test_the_runs_jobs_are_listed_by_role(tmp_path):
    jobs = RunJobs(tmp_path)
    jobs.add("12", "trainer", "/r/trainer-12.log")
    jobs.add("13", "rollout", "/r/rollout-%A_%a.log")
    jobs.add("14", "reward", "/r/w-14.err")
    jobs.add("15", "reward", "/r/w-15.err")
    assert jobs.summary() == "trainer 12, rollout 13, reward 14 15"
    assert jobs.ids(("reward",)) == ["14", "15"]
    (tmp_path / "config.json").write_text(json.dumps({"name": "q", "trainer": {"max_steps": 5}}))
    assert describe(tmp_path).jobs == "trainer 12, rollout 13, reward 14 15"


def _announce_many(path: str, k: int) -> None:
    for i in range(20):
        announce(path, [f"http://10.0.{k}.{i}:1"])


def test_servers_announcing_at_once_take_turns_on_the_join_list(tmp_path):
    path = str(tmp_path / "join.txt")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_announce_many, args=(path, k)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert len(read_urls(path)) == 80  # none lost to a writer that read the list before another wrote it


def test_on_slurm_the_run_folder_holds_the_join_list_and_the_trainer_address_is_the_master(tmp_path):
    cfg = with_run_folder(load_config(E2E, {"cluster": SLURM}), tmp_path)
    assert cfg.rollout.join_from == str(tmp_path.resolve() / "slurm/rollout-servers.txt")
    assert with_run_folder(load_config(E2E), tmp_path).rollout.join_from is None

    class Backend:
        trainer_address = "10.1.2.3"

    assert weight_transport(cfg, Backend()).master_address == "10.1.2.3"
    mine = load_config(
        E2E, {"cluster": SLURM, "rollout.weight_transport": {"kind": "distributed", "master_address": "10.9.9.9"}}
    )
    assert weight_transport(mine, Backend()).master_address == "10.9.9.9"


def test_the_reward_workers_jobs_preload_the_graders_over_tls(tmp_path):
    from dask_jobqueue.slurm import SLURMJob

    c = SlurmClusterConfig(
        **SLURM, setup=["source /v/bin/activate"], reward={"memory": "8G", "extra_sbatch": ["--qos=low"]}
    )
    opts = jobqueue_options(RewardConfig(n_workers=2, threads_per_worker=2), c, str(tmp_path), "x", "10.0.0.1")
    assert opts["memory"] == "8GiB" and opts["job_mem"] == "8G" and opts["job_cpu"] == 2
    script = SLURMJob(scheduler="tls://10.0.0.1:8786", name="w", protocol="tls://", **opts).job_script()
    for line in ("#SBATCH -p gpu", "#SBATCH -A rl", "#SBATCH -t 2-00:00:00", "#SBATCH --mem=8G", "#SBATCH --qos=low"):
        assert line in script
    assert "#SBATCH --no-requeue" in script and "source /v/bin/activate" in script
    assert "tls://10.0.0.1:8786" in script and "--preload areal_core.reward.math" in script
    assert "--death-timeout 60" in script
    # each worker listens on its node's address towards the scheduler, worked out in the job
    host_line = next(line for line in script.splitlines() if line.startswith("AREAL_WORKER_HOST=$("))
    assert "address_towards" in host_line and "10.0.0.1" in host_line and '--host "$AREAL_WORKER_HOST"' in script
    assert script.index("AREAL_WORKER_HOST=$(") > script.index("source /v/bin/activate")
    plain = jobqueue_options(RewardConfig(), SlurmClusterConfig(), str(tmp_path), "x", "h")
    assert "#SBATCH --mem" not in SLURMJob(scheduler="tls://h:1", name="w", **plain).job_script()


def test_dask_jobqueue_is_imported_without_taking_ctrl_c_from_the_run():
    """dask-jobqueue sets a SIGINT handler when imported; the run's stays, and a Prefect task's thread
    can import it (a fresh process: the import happens once)."""
    code = (
        "import signal, threading\n"
        "from areal_core.cluster.reward_pool import _slurm_cluster_class\n"
        "mine = lambda *a: None\n"
        "signal.signal(signal.SIGINT, mine)\n"
        "errors = []\n"
        "def load():\n"
        "    try:\n"
        "        _slurm_cluster_class()\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "t = threading.Thread(target=load); t.start(); t.join()\n"
        "print(errors, signal.getsignal(signal.SIGINT) is mine)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["[]", "True"], out.stderr[-2000:]
