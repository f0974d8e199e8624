"""Config errors fail before anything starts and name file, line, key and expectation."""

import json
from pathlib import Path

import pytest

from areal_core.data.records import read_records
from areal_core.experiment import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_every_shipped_config_loads():
    paths = sorted((REPO / "configs").glob("*.yaml"))
    assert paths, "no configs shipped"
    for p in paths:
        load_config(p)


def test_unknown_key_names_line_and_choices(tmp_path):
    p = _write(tmp_path, "name: x\ntrainer:\n  batch_size: 16\n  etaa: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:4" in msg and "trainer.etaa" in msg and "unknown key" in msg and "eta" in msg


def test_wrong_type(tmp_path):
    p = _write(tmp_path, "trainer:\n  eta: four\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:2: trainer.eta: .*integer.*'four'"):
        load_config(p)


def test_no_silent_coercion_of_strings(tmp_path):
    p = _write(tmp_path, "trainer:\n  batch_size: '128'\n")
    with pytest.raises(ConfigError, match=r"trainer.batch_size"):
        load_config(p)


def test_negative_eta(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.eta: .*greater than or equal to 0"):
        load_config(_write(tmp_path, "trainer:\n  eta: -1\n"))


def test_batch_must_hold_whole_groups(tmp_path):
    with pytest.raises(ConfigError, match=r"batch_size \(100\) must be a multiple of rollout.n_samples \(8\)"):
        load_config(_write(tmp_path, "trainer:\n  batch_size: 100\nrollout:\n  n_samples: 8\n"))


def test_minibatches_must_divide(tmp_path):
    with pytest.raises(ConfigError, match="ppo_minibatches"):
        load_config(_write(tmp_path, "trainer:\n  batch_size: 64\n  ppo_minibatches: 3\n"))


@pytest.mark.parametrize("key,value,expected", [("top_p", 0.9, "must be 1.0"), ("top_k", 20, "must be 0")])
def test_training_refuses_filtered_sampling(tmp_path, key, value, expected):
    p = _write(tmp_path, f"rollout:\n  sampling:\n    {key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:3: rollout.sampling.{key}:" in msg and f"rollout.sampling.{key} {expected}" in msg
    assert "training needs the unfiltered distribution" in msg and f"got {value}" in msg


def test_bad_literal(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.objective: .*'decoupled' or 'naive'"):
        load_config(_write(tmp_path, "trainer:\n  objective: grpo\n"))


def test_missing_dataset(tmp_path):
    with pytest.raises(ConfigError, match=r"data.dataset: dataset file 'nope.jsonl' not found"):
        load_config(_write(tmp_path, "data:\n  dataset: nope.jsonl\n"))


def test_missing_model_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"model.name: 'no/such/model' is neither a built-in model"):
        load_config(_write(tmp_path, "model:\n  name: no/such/model\n"))


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"exp.yaml:3: not valid YAML"):
        load_config(_write(tmp_path, "a: 1\nb: [1, 2\nc: 3\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/no/such/config.yaml")


def test_overrides_are_validated(tmp_path):
    p = _write(tmp_path, "trainer:\n  eta: 4\n")
    assert load_config(p, {"trainer.eta": 0}).trainer.eta == 0
    with pytest.raises(ConfigError, match=r"trainer.eta"):
        load_config(p, {"trainer.eta": -2})


def test_continue_warm_start_needs_a_warm_started_tiny_model(tmp_path):
    text = "model:\n  name: tiny\n  warm_start: {steps: %d}\ntrainer:\n  optim: {continue_warm_start: true}\n"
    load_config(_write(tmp_path, text % 10))
    with pytest.raises(ConfigError, match="continue_warm_start needs the tiny model with a warm start"):
        load_config(_write(tmp_path, text % 0))


def test_warm_start_length_alpha_needs_chain_lengths(tmp_path):
    """length_alpha weights the chain task's demonstrations by their length (meta.k): the synthetic task,
    or its records written out (what a campaign trains on); records without a chain length are refused
    by name when the warm start reads them."""
    from areal_core.data.prepare import prepare
    from areal_core.data.records import Record
    from areal_core.models.loading import warm_start_inputs

    text = "model:\n  warm_start: {length_alpha: 3.0}\n"
    cfg = load_config(_write(tmp_path, text))
    assert cfg.model.warm_start.length_alpha == 3.0
    files = prepare("synthetic", str(tmp_path / "data"), synthetic=cfg.data.synthetic.model_dump())["files"]
    quickstart = load_config(
        ROOT / "configs/quickstart.yaml", {"data.dataset": files["train"]}
    )  # as a campaign runs it
    pairs, weights, _ = warm_start_inputs(quickstart.model, read_records(files["train"]))
    assert len(weights) == len(pairs) and len(set(weights)) > 1  # weighted by chain length
    no_k = [Record(id="r1", prompt="1+1=", solution="2", task="math", answer="2")]
    with pytest.raises(
        ValueError, match=r"length_alpha needs chain-task records with a chain length \(meta.k\); record 'r1'"
    ):
        warm_start_inputs(cfg.model, no_k)
    with pytest.raises(ConfigError, match="length_alpha"):
        load_config(_write(tmp_path, "model:\n  warm_start: {length_alpha: -1}\n"))


def test_curriculum_settings_are_checked(tmp_path):
    cfg = load_config(_write(tmp_path, "data:\n  curriculum: {by: k}\n"))
    assert (cfg.data.curriculum.by, cfg.data.curriculum.ema, cfg.data.curriculum.floor) == ("k", 0.2, 0.02)
    with pytest.raises(ConfigError, match="chain task's records are grouped by 'k'"):
        load_config(_write(tmp_path, "data:\n  curriculum: {by: level}\n"))
    with pytest.raises(ConfigError, match="arith task's records are grouped by 'op'"):
        load_config(_write(tmp_path, "data:\n  synthetic: {kind: arith}\n  curriculum: {by: k}\n"))
    with pytest.raises(ConfigError, match=r"data.curriculum.floor: .*less than or equal to 0.25"):
        load_config(_write(tmp_path, "data:\n  curriculum: {by: k, floor: 0.5}\n"))
    with pytest.raises(ConfigError, match=r"data.curriculum.by"):
        load_config(_write(tmp_path, "data:\n  curriculum: {ema: 0.5}\n"))


def test_missing_model_or_dataset_names_where_it_was_set(tmp_path):
    p = _write(tmp_path, "name: x\nmodel:\n  name: nowhere\n")
    with pytest.raises(ConfigError, match=rf"^{p}:3: model.name: 'nowhere' is neither"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^--set model.name='': model.name: '' is neither"):
        load_config(p, {"model.name": ""})
    with pytest.raises(ConfigError, match=r"^--set data.dataset=gone.jsonl: data.dataset: dataset file 'gone.jsonl'"):
        load_config(p, {"model.name": "tiny", "data.dataset": "gone.jsonl"})


def test_trainer_threads_default_split():
    from areal_core.run.setup import trainer_torch_threads

    base = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    sync = load_config(base, {"trainer.eta": 0, "rollout.weight_update": "drain"})
    assert trainer_torch_threads(sync, 8) == 8  # generation idles while it trains: every core
    asyn = load_config(base, {"rollout.n_servers": 2, "rollout.torch_threads": 2})
    assert trainer_torch_threads(asyn, 8) == 4  # what two servers of two threads leave
    assert trainer_torch_threads(asyn, 2) == 1  # never below one
    assert trainer_torch_threads(load_config(base, {"trainer.torch_threads": 3}), 2) == 3  # as set


def test_micro_batch_must_hold_a_whole_trajectory(tmp_path):
    text = "rollout:\n  sampling: {max_new_tokens: 128}\ntrainer:\n  max_tokens_per_microbatch: %d\n"
    assert load_config(_write(tmp_path, text % 129)).trainer.max_tokens_per_microbatch == 129
    with pytest.raises(
        ConfigError,
        match=r"trainer.max_tokens_per_microbatch \(128\) must hold a whole trajectory.*"
        r"rollout.sampling.max_new_tokens \(128\)",
    ):
        load_config(_write(tmp_path, text % 128))
    load_config(_write(tmp_path, text % 128), {"trainer.microbatching": "fixed"})  # no token budget


def test_longest_prompt_is_checked_against_the_micro_batch_budget_before_the_model(tmp_path, monkeypatch):
    """Prompt + max_new_tokens above the budget would fail in the middle of training (allocate_microbatches
    refuses a sequence longer than the budget); it fails before the warm start instead, naming the record."""
    from areal_core.algo import allocate_microbatches
    from areal_core.data.datasets import to_prompts
    from areal_core.data.synthetic import ChainTask
    from areal_core.models import build_char_tokenizer
    from areal_core.run import setup as run_module

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(run_module, "load_base_model", no_model)
    cfg = load_config(
        _write(tmp_path, "rollout:\n  sampling: {max_new_tokens: 40}\ntrainer:\n  max_tokens_per_microbatch: 48\n")
    )
    prompts = to_prompts(ChainTask(cfg.data.synthetic).train_records(), build_char_tokenizer())
    longest = max(prompts, key=lambda p: len(p.input_ids))
    need = len(longest.input_ids) + 40
    assert need > 48
    with pytest.raises(ValueError, match="exceeds the micro-batch budget"):
        allocate_microbatches([need], 48)  # what a training step would have hit
    with pytest.raises(
        ConfigError,
        match=rf"trainer.max_tokens_per_microbatch \(48\) is too small for record "
        rf"'{longest.id}': its prompt of {len(longest.input_ids)} tokens \+ "
        rf"rollout.sampling.max_new_tokens \(40\) = {need} tokens",
    ):
        run_module.run_experiment(cfg, tmp_path / "run", progress=False)


def test_log_every_is_gone(tmp_path):
    """It did nothing (metrics are written every step); a config that sets it is told so."""
    p = _write(tmp_path, "name: x\nlog_every: 10\n")
    with pytest.raises(ConfigError, match=rf"{p}:2: log_every: unknown key; expected one of: .*trainer"):
        load_config(p)


def test_set_values_in_scientific_notation_are_numbers(tmp_path):
    """YAML 1.1 reads ``1e-5`` as text; ``--set trainer.optim.lr=1e-5`` must still mean the number."""
    from areal_core.experiment import parse_overrides

    got = parse_overrides(["trainer.optim.lr=1e-5", "a=2E3", "b=-1.5e-2", "c=x1e5", "d=3"])
    assert got == {"trainer.optim.lr": 1e-5, "a": 2000.0, "b": -0.015, "c": "x1e5", "d": 3}
    cfg = load_config(_write(tmp_path, "name: x\n"), parse_overrides(["trainer.optim.lr=1e-5"]))
    assert cfg.trainer.optim.lr == 1e-5


def test_extends_merges_a_base_config_and_blames_the_file_that_set_a_key(tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\ntrainer:\n  eta: 2\n  batch_size: 16\nrollout:\n  n_samples: 4\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nname: child\ntrainer:\n  eta: 0\n")
    cfg = load_config(child)
    assert (cfg.name, cfg.trainer.eta, cfg.trainer.batch_size, cfg.rollout.n_samples) == ("child", 0, 16, 4)
    (tmp_path / "base.yaml").write_text("name: base\ntrainer:\n  etaa: 2\n")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'base.yaml'}:3: trainer.etaa: unknown key"):
        load_config(child)
    (tmp_path / "base.yaml").write_text("name: base\n")
    child.write_text("extends: base.yaml\ntrainer:\n  eta: -1\n")
    with pytest.raises(ConfigError, match=rf"{child}:3: trainer.eta: Input should be greater than or equal to 0"):
        load_config(child)
    child.write_text("extends: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.yaml \(extended by .*child.yaml\)"):
        load_config(child)
    child.write_text("extends: child.yaml\n")
    with pytest.raises(ConfigError, match=r"child.yaml:1: extends: child.yaml leads back to itself"):
        load_config(child)
    child.write_text("extends: [a, b]\n")
    with pytest.raises(ConfigError, match=r"child.yaml:1: extends: expected the path of the config file"):
        load_config(child)


def test_shipped_configs_that_extend_others_load():
    lora = load_config(Path(__file__).parents[2] / "configs/smollm2_lora.yaml")
    base = load_config(Path(__file__).parents[2] / "configs/smollm2_quickstart.yaml")
    assert lora.trainer.lora is not None and base.trainer.lora is None
    assert lora.trainer.optim.lr != base.trainer.optim.lr
    assert lora.data == base.data and lora.rollout == base.rollout


def test_a_run_saved_before_a_key_was_added_still_resumes():
    """A checkpoint's config from before ``trainer.off_policy`` existed (it had ``behav_weight_cap: null``)
    reads as the current default; one whose cap was set does not (it trained otherwise)."""
    from areal_core.experiment import load_config, upgraded_config
    from areal_core.storage.config_keys import config_differences

    current = load_config("configs/quickstart.yaml").model_dump(mode="json")
    saved = json.loads(json.dumps(current))
    del saved["trainer"]["off_policy"]
    saved["trainer"]["behav_weight_cap"] = None
    assert config_differences(saved, current)  # compared as saved, the new key differs
    assert config_differences(upgraded_config(saved), current) == []
    saved["trainer"]["behav_weight_cap"] = 5.0
    with pytest.raises(ValueError):
        upgraded_config(saved)


def test_relative_paths_are_read_from_the_configs_folder_wherever_the_run_starts(tmp_path, monkeypatch):
    """A dataset named relative to the config's folder is checked there and read from there too: the
    loaded config holds its absolute path, so a run started from another folder finds it."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    records = folder / "data/train.jsonl"
    records.write_text("")
    (folder / "exp.yaml").write_text("data:\n  dataset: data/train.jsonl\n  eval_dataset: data/train.jsonl\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "exp.yaml")
    assert cfg.data.dataset == str(records.resolve()) == cfg.data.eval_dataset
