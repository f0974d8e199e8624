"""A run's pools as jobs of a real Slurm cluster (tests/slurm_cluster.py: munged, slurmctld and three
slurmd nodes, each in a network namespace of its own), driven from the controller host as a run would:

- the rollout pool, a job array of `areal-flow rollout-server` tasks on the node the config names:
  each serves on that node's address, announces itself in the join list, answers only with the
  run's key (which is in neither the job's script nor its command line), and leaving the launch
  cancels the array, the servers taking themselves out of the list;
- the reward workers, dask-jobqueue jobs over the run's TLS: a known answer graded on the node's
  worker, no connection without the certificate, the jobs gone after;
- a pool that cannot come up stops with one line naming its job, state, node and log file.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from areal_core.experiment import load_config
from areal_core.models import build_char_tokenizer, build_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_cluster import slurm_cluster, unavailable

HERE = Path(__file__).resolve().parents[1]  # tests/
REPO = HERE.parent
KEY = "slurm-pool-test-key"

# nightly (about 50 s of jobs on a 2-core EPYC); the parts without daemons, tests/unit/test_slurm_parts.py, in make test
pytestmark = [
    pytest.mark.slow,
    pytest.mark.nightly,
    pytest.mark.skipif(bool(unavailable()), reason=f"Slurm: {unavailable()}"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _on_login_node(cluster, code: str, timeout_s: float = 300.0) -> dict:
    """Run ``code`` (it prints one JSON object last) with this Python on the controller host."""
    out = cluster.ctl.python(textwrap.dedent(code), env={**cluster.env, "PYTHONPATH": str(REPO)}, timeout_s=timeout_s)
    return json.loads(out.strip().splitlines()[-1])


ROLLOUT = """
import json, urllib.request, urllib.error
from areal_core.cluster import slurm
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.rollout_pool import SlurmRolloutBackend
from areal_core.rollout.config import EngineConfig
from areal_core.rollout.join_list import read_urls

run = {run!r}
cluster = SlurmClusterConfig(rollout={{"extra_sbatch": ["--nodelist=n2"]}}, start_timeout_s=240)
b = SlurmRolloutBackend(n_servers=2, cluster=cluster, engine=EngineConfig(max_running=8), run_dir=run,
    run_name="pool", api_key={key!r}, join_from=run + "/join.txt", trainer_address="{ctl}", seed=0)

def info(url, key):
    r = urllib.request.Request(url + "/model_info", headers={{"Authorization": "Bearer " + key}} if key else {{}})
    try:
        return json.loads(urllib.request.urlopen(r, timeout=30).read())["weight_version"]
    except urllib.error.HTTPError as e:
        return e.code

with b.launch({model!r}, 0) as urls:
    out = dict(urls=urls, job=b.job_id, tasks=[t.describe() for t in slurm.jobs(b.job_id)],
               listed=read_urls(run + "/join.txt"), with_key=[info(u, {key!r}) for u in urls],
               without=[info(u, None) for u in urls])
    cmdlines = []
    import os
    for pid in os.listdir("/proc"):
        if pid == str(os.getpid()):
            continue
        try:
            argv = open(f"/proc/{{pid}}/cmdline", "rb").read().decode().split("\\0")
        except OSError:
            continue
        # the servers: `areal-flow rollout-server ...` (the console script, under its Python or not)
        words = argv[1:] if argv and argv[0].endswith("python") else argv
        if len(words) > 1 and words[0].endswith("/areal-flow") and words[1] == "rollout-server":
            cmdlines.append(" ".join(argv))
    out["cmdlines"] = cmdlines
out["after"] = slurm.queued([b.job_id])
out["listed_after"] = read_urls(run + "/join.txt")
print(json.dumps(out))
"""


def test_the_rollout_pool_is_a_job_array_that_serves_and_is_cancelled(cluster):
    model = cluster.shared / "model"
    build_tiny(load_config(HERE / "data/e2e.yaml").model.tiny, tok := build_char_tokenizer(), seed=3).save_pretrained(
        model
    )
    tok.save_pretrained(model)
    run = cluster.shared / "pool-run"
    out = _on_login_node(cluster, ROLLOUT.format(run=str(run), key=KEY, ctl=cluster.ctl.address, model=str(model)))
    n2 = cluster.nodes["n2"].address
    assert sorted(u.rsplit(":", 1)[0] for u in out["urls"]) == [f"http://{n2}", f"http://{n2}"], out
    assert sorted(out["listed"]) == sorted(out["urls"])  # each announced itself once serving
    assert all("RUNNING on n2" in t for t in out["tasks"]), out["tasks"]
    assert out["with_key"] == [0, 0] and out["without"] == [401, 401]
    script = (run / "slurm/rollout.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --nodelist=n2" in script
    assert KEY not in script and len(out["cmdlines"]) == 2 and not any(KEY in c for c in out["cmdlines"])
    assert out["after"] == [] and out["listed_after"] == []  # cancelled; the servers took themselves out
    assert json.loads((run / "slurm/jobs.json").read_text())[0]["role"] == "rollout"


REWARD = """
import json
from distributed import Client
from areal_core.cluster import slurm
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.jobs import RunJobs
from areal_core.cluster.reward_pool import slurm_reward_service
from areal_core.reward.config import RewardConfig

run = {run!r}
cluster = SlurmClusterConfig(reward={{"extra_sbatch": ["--nodelist=n3"]}}, start_timeout_s=240)
with slurm_reward_service(RewardConfig(n_workers=1), cluster, run, "pool", "{ctl}") as svc:
    [verdict] = svc.grade_many("chain", ["a1b3|3"], ["a1b3|3"])
    address = svc.scheduler_address
    workers = list(svc.client.nthreads())
    try:
        Client(address.replace("tls://", "tcp://"), timeout="5s").close()
        plain = "connected"
    except (OSError, TimeoutError) as e:
        plain = type(e).__name__
    ids = RunJobs(run).ids(("reward",))
    running = [slurm.job(i).describe() for i in ids]
print(json.dumps(dict(correct=verdict.correct, address=address, workers=workers, plain=plain, ids=ids,
                      running=running, after=slurm.queued(ids))))
"""


def test_the_reward_workers_are_slurm_jobs_over_the_runs_tls(cluster):
    run = cluster.shared / "reward-run"
    out = _on_login_node(cluster, REWARD.format(run=str(run), ctl=cluster.ctl.address))
    assert out["correct"] is True
    assert out["address"].startswith(f"tls://{cluster.ctl.address}:")
    assert [w.split("//")[1].rsplit(":", 1)[0] for w in out["workers"]] == [cluster.nodes["n3"].address]
    assert out["plain"] != "connected"
    assert len(out["ids"]) == 1 and "RUNNING on n3" in out["running"][0]
    assert out["after"] == []
    assert not list((run / "slurm").glob("dask-tls-*"))  # the certificates' folder is removed


NOT_READY = """
import json
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.rollout_pool import SlurmRolloutBackend
from areal_core.cluster.slurm import PoolNotReady, queued
from areal_core.rollout.config import EngineConfig

run = {run!r}
out = {{}}
for name, cluster in (
    ("fails", SlurmClusterConfig(setup=["echo 'no such environment' >&2", "false"], start_timeout_s=120)),
    ("pending", SlurmClusterConfig(rollout={{"extra_sbatch": ["--begin=now+1hour"]}}, start_timeout_s=3)),
):
    b = SlurmRolloutBackend(n_servers=1, cluster=cluster, engine=EngineConfig(), run_dir=run + "/" + name,
        run_name=name, api_key="k", join_from=run + "/" + name + "/join.txt", trainer_address="{ctl}", seed=0)
    try:
        with b.launch("/nonexistent", 0):
            out[name] = "served"
    except PoolNotReady as e:
        out[name] = str(e)
    out[name + "_left"] = queued([b.job_id])
print(json.dumps(out))
"""


def test_a_pool_that_cannot_come_up_says_which_job_and_where_its_log_is(cluster):
    run = cluster.shared / "not-ready"
    out = _on_login_node(cluster, NOT_READY.format(run=str(run), ctl=cluster.ctl.address))
    failed = out["fails"]
    assert "ended before serving" in failed and "FAILED" in failed and " on n" in failed, failed
    assert str(run / "fails/slurm/rollout-") in failed and "no such environment" in failed, failed
    pending = out["pending"]
    assert "0 of 1 serving after cluster.start_timeout_s (3 s)" in pending and "PENDING (BeginTime)" in pending, pending
    assert str(run / "pending/slurm/rollout-") in pending
    assert out["fails_left"] == [] and out["pending_left"] == []


PROVISION = """
import json
from areal_core.cluster.slurm import queued
from areal_core.experiment import load_config
from areal_core.ops.provision import provision

cluster = {{"kind": "slurm", "reward": {{"extra_sbatch": ["--nodelist=n3"]}}, "start_timeout_s": 240}}
cfg = load_config({config!r}, {{"cluster": cluster}})
report = provision(cfg, {out!r})
report["left"] = queued(report["dask"]["slurm_jobs"])
print(json.dumps(report))
"""


def test_the_provision_step_brings_up_the_reward_workers_as_jobs_and_checks_them(cluster):
    """What the provision flow runs with cluster: slurm: the reward workers as Slurm jobs, a known
    answer graded on them, the jobs cancelled; the report names them and the trainer's address."""
    out_dir = cluster.shared / "provision"
    report = _on_login_node(cluster, PROVISION.format(config=str(HERE / "data/e2e.yaml"), out=str(out_dir)))
    assert len(report["dask"]["slurm_jobs"]) == 1 and report["dask"]["workers"] == 1, report
    assert report["dask"]["probe_address"].startswith(f"tls://{cluster.ctl.address}:")
    assert report["slurm"]["trainer_address"] == cluster.ctl.address and report["left"] == []
    assert report["storage"] and report["rollout"]["backend"] == "slurm"
