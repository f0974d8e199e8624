"""A finished run's optimizer state dropped from its checkpoints (``CheckpointStore.drop_files``,
``run_state.drop_trainer_state``): the manifest no longer lists it before the file goes, the weights
and the small run state stay and verify, a resume or replay is refused saying why, and a campaign
drops it from every run it finished unless told to keep it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_core.run.campaign import CampaignPlan, run_campaign, run_dir_of
from areal_core.run.folder import code_version
from areal_core.storage import CheckpointStore
from areal_core.storage.run_state import FORMAT, METRICS, STATE, TRAINER, ResumeError, check_resumable

CONFIG = {"seed": 0, "trainer": {"batch_size": 4}}


def _publish(store: CheckpointStore, version: int, tmp: Path) -> dict[str, bytes]:
    """A version as a run writes it: weights, its run state and a (fake) optimizer state."""
    files = {
        "model.safetensors": b"w" * 300 + bytes([version]),
        STATE: json.dumps({"format": FORMAT, "step": version, "config": CONFIG, "code": code_version()}).encode(),
        TRAINER: b"o" * 1000 + bytes([version]),
        METRICS: b"m" * 10,
    }
    folder = tmp / f"src-v{version}"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    store.publish_folder(version, str(folder))
    return files


def test_dropping_a_file_rewrites_the_manifest_first_and_keeps_the_rest_whole(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    files = _publish(store, 10, tmp_path)
    before = store.read_manifest(10)

    assert store.drop_files(10, [TRAINER, "not/there.bin"]) == len(files[TRAINER])
    after = store.read_manifest(10)
    assert [e["path"] for e in after["files"]] == [e["path"] for e in before["files"] if e["path"] != TRAINER]
    assert after["meta"]["dropped"] == [TRAINER] and after["created"] == before["created"]
    assert not (tmp_path / "ckpt/v10" / TRAINER).exists()
    store.verify(10)  # every file still listed is there, bit for bit
    assert store.read_file(10, "model.safetensors") == files["model.safetensors"]
    assert store.read_file(10, STATE) == files[STATE]
    with pytest.raises(FileNotFoundError, match=r"no file 'resume/trainer\.pt' in its manifest"):
        store.read_file(10, TRAINER)
    assert store.versions() == [10] and store.latest() == 10
    # again: nothing left to drop, the manifest unchanged
    assert store.drop_files(10, [TRAINER]) == 0 and store.read_manifest(10) == after


def test_a_run_whose_optimizer_state_was_dropped_is_refused_a_resume_saying_so(tmp_path):
    from areal_core.storage.run_state import drop_trainer_state

    store = CheckpointStore(str(tmp_path / "ckpt"))
    sizes = [len(_publish(store, v, tmp_path)[TRAINER]) for v in (10, 20)]
    assert check_resumable(store, CONFIG)[0] == 20  # whole: it resumes
    assert drop_trainer_state(store) == sum(sizes)
    assert all(TRAINER not in [e["path"] for e in store.read_manifest(v)["files"]] for v in (10, 20))
    with pytest.raises(ResumeError, match=r"v20 no longer holds the optimizer state .*--keep-run-state"):
        check_resumable(store, CONFIG)


class Trainer:
    """Leaves what a finished run leaves: config.json, summary.json and two checkpoints holding
    an optimizer state."""

    def __init__(self, tmp: Path):
        self.tmp = tmp

    def __call__(self, label: str, seed: int, ov: dict, run_dir: Path, resume: bool) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        store = CheckpointStore(str(run_dir / "checkpoints"))
        for v in (10, 20):
            _publish(store, v, self.tmp / f"{label}-{seed}")
        (run_dir / "config.json").write_text(json.dumps({"seed": seed, "x": ov["x"]}))
        after = 0.4 + 0.01 * seed + (0.05 if label == "b" else 0.0)
        (run_dir / "summary.json").write_text(
            json.dumps({"accuracy_before": 0.2, "accuracy_after": after, "code": code_version()})
        )


@pytest.mark.parametrize("keep", [False, True])
def test_a_campaign_drops_the_optimizer_state_of_the_runs_it_finished_unless_kept(tmp_path, keep):
    plan = CampaignPlan([("a", {"x": "a"}), ("b", {"x": "b"})], "a", seeds=2, keep_run_state=keep)
    said: list[str] = []
    run_campaign(plan, tmp_path / "out", lambda ov: {"seed": ov["seed"], "x": ov["x"]}, Trainer(tmp_path), said.append)
    for label in ("a", "b"):
        for seed in (0, 1):
            store = CheckpointStore(str(run_dir_of(tmp_path / "out", label, seed) / "checkpoints"))
            held = {v: [e["path"] for e in store.read_manifest(v)["files"]] for v in (10, 20)}
            assert all((TRAINER in paths) == keep and "model.safetensors" in paths for paths in held.values())
            store.verify(20)
    dropped = [line for line in said if "optimizer state dropped" in line]
    assert len(dropped) == (0 if keep else 4)
    # started again: the reused runs have nothing left to drop, and nothing is said of them
    said.clear()
    run_campaign(plan, tmp_path / "out", lambda ov: {"seed": ov["seed"], "x": ov["x"]}, Trainer(tmp_path), said.append)
    assert [line for line in said if "reused" in line] and not [line for line in said if "dropped" in line]
