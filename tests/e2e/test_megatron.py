"""The megatron-core trainer backend on CPU: the HF <-> megatron mapping is exact, a step is the torch
trainer's step, and tensor / data parallelism over 2 gloo processes give the same numbers.

The 2-process checks run this file as a script (``python tests/e2e/test_megatron.py CASE OUT``) on 2
ranks started with torchrun's environment variables; rank 0 writes what it measured as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the `megatron` extra: make setup)")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from areal_core.net import free_port
from areal_core.trainer.config import TrainerConfig
from areal_core.trainer.megatron import mapping, parallel, shims
from areal_core.trainer.megatron.trainer import MegatronTrainer
from areal_core.trainer.trainer import Trainer
from areal_core.types import Trajectory

# megatron's own notices about the CPU fallbacks (no Apex / Transformer Engine) and its deprecations
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}
VOCAB = 61  # not a multiple of 2: tensor parallelism pads the vocabulary


def hf_model(kind: str = "qwen2", tied: bool | None = None, seed: int = 0):
    """A tiny random HF model (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16) whose norms and
    biases are perturbed, so a mapping that mixes them up shows."""
    tied = kind == "qwen2" if tied is None else tied
    cfg = CONFIGS[kind](
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def hf_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def megatron_logits(arch, weights, tp: int, rank: int, ids: torch.Tensor) -> torch.Tensor:
    module = mapping.build_gpt(arch, tp)
    shims.apply_cpu_shims(module, seed=0, tp_rank=rank)
    mapping.load_into(module, mapping.hf_to_megatron(weights, arch, tp, rank))
    S = ids.shape[1]
    with torch.no_grad():
        local = module(ids, torch.arange(S)[None].expand_as(ids), shims.causal_mask(S))  # vocab-parallel
    parts = [local]
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[..., : arch.vocab]


def swap_gate_up(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(weights)
    for n in weights:
        if n.endswith("gate_proj.weight"):
            up = n.replace("gate_proj", "up_proj")
            out[n], out[up] = weights[up], weights[n]
    return out


def batch(n: int = 8, seed: int = 0) -> list[Trajectory]:
    """Groups of 4 answers sharing a prompt, mixed lengths, behaviour logprobs near the model's."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 0:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 7))]
        answer = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]
        out.append(
            Trajectory(
                traj_id=f"t{i}",
                group_id=f"g{i // 4}",
                seq_no=i,
                admit_version=0,
                prompt_ids=prompt,
                output_ids=answer,
                output_logprobs=[-4.1 + 0.05 * (k % 3) for k in range(len(answer))],
                output_versions=[0] * len(answer),
                finish_reason="stop",
                reward=float(i % 3 == 0) * 10 - 5,
                correct=i % 3 == 0,
            )
        )
    return out


def trainer_cfg(grad_clip: float = 1e6, **kw) -> TrainerConfig:
    return TrainerConfig(
        batch_size=8,
        max_tokens_per_microbatch=40,
        optim={"lr": 1e-3, "lr_schedule": "constant", "grad_clip": grad_clip},
        **kw,
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def torch_reference(model, cfg: TrainerConfig, b, temperature: float = 0.8):
    """The torch trainer's step: (stats, gradients by HF name, weights after the step)."""
    ref = Trainer(model, cfg, temperature=temperature, total_steps=10)
    stats = ref.step(b, version=1).metrics
    grads = {n: m.grad.clone() for n, m in ref.named_masters().items()}
    return stats, grads, hf_weights(model)


# --------------------------------------------------------------------------- in-process (world size 1)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    parallel.init_parallel(1)
    yield
    parallel.shutdown()


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_mapping_is_exact_at_tp1(kind):
    model = hf_model(kind)
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    arch = mapping.arch_of(model.config, 1)
    out = megatron_logits(arch, hf_weights(model), 1, 0, ids)
    assert float((out - ref).abs().max()) == 0.0
    bad = megatron_logits(arch, swap_gate_up(hf_weights(model)), 1, 0, ids)
    assert float((bad - ref).abs().max()) > 1e-2  # the check can fail


@pytest.mark.parametrize("kind, tp", [("qwen2", 1), ("qwen2", 2), ("llama", 2), ("qwen3", 2), ("llama", 4)])
def test_megatron_to_hf_round_trip_is_bit_exact(kind, tp):
    model = hf_model(kind)
    if tp == 4:  # 4 heads and 4 KV heads, so 4 ranks divide both
        cfg = copy.deepcopy(model.config)
        cfg.num_key_value_heads = 4
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    arch = mapping.arch_of(model.config, tp)
    w = hf_weights(model)
    shards = [mapping.hf_to_megatron(w, arch, tp, r) for r in range(tp)]
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == arch.padded_vocab(tp) // tp
    full = mapping.hf_to_megatron(w, mapping.arch_of(model.config, 1), 1, 0)
    for n, t in shards[0].items():  # the gradient norm counts a replicated parameter once
        assert tp == 1 or mapping.is_sharded(n) == (t.shape != full[n].shape), n
    back = mapping.megatron_to_hf(shards, arch)
    assert list(back) == list(w)
    assert all(torch.equal(back[n], w[n]) for n in w)


@pytest.mark.parametrize("tp, heads, kv", [(3, 4, 2), (4, 4, 2)])
def test_tp_that_does_not_divide_the_heads_is_a_clear_error(tp, heads, kv):
    cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=VOCAB,
    )
    with pytest.raises(ValueError, match=rf"tensor-parallel size {tp} must divide .*heads \({heads}\).*heads \({kv}\)"):
        mapping.arch_of(cfg, tp)


def test_unsupported_model_and_world_size_are_clear_errors():
    cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=VOCAB,
        hidden_act="gelu",
    )
    with pytest.raises(NotImplementedError, match="hidden_act 'gelu'"):
        mapping.arch_of(cfg, 1)
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 must divide the number of processes \(1\)"):
        MegatronTrainer(hf_model("qwen2"), trainer_cfg(), 0.8, 10, tp_size=2)


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("qwen2", {"grad_clip": 0.5}),  # decoupled, one minibatch: pi_prox is the update's own forward; clipped
        ("llama", {"ppo_minibatches": 2}),  # decoupled, pi_prox recomputed before the update
        ("llama", {"ppo_minibatches": 2, "prox_logp": "loglinear"}),
        ("qwen2", {"objective": "naive", "microbatching": "fixed", "n_microbatches": 3, "temperature": 1.0}),
    ],
)
def test_one_step_matches_the_torch_trainer(kind, kw):
    kw = dict(kw)
    temperature = kw.pop("temperature", 0.8)
    cfg, b = trainer_cfg(**kw), batch()
    ref_stats, ref_grads, ref_after = torch_reference(hf_model(kind), cfg, b, temperature)
    model = hf_model(kind)
    trainer = MegatronTrainer(model, cfg, temperature=temperature, total_steps=10)
    stats = trainer.step(b, version=1).metrics
    assert stats["prox_logp_path"] == ref_stats["prox_logp_path"]
    for k in (
        "loss",
        "clip_fraction",
        "behav_weight_mean",
        "behav_weight_max",
        "approx_kl",
        "importance_weight_mean",
        "grad_norm",
        "lr",
        "tokens_trained",
        "staleness_max",
        "reward",
    ):
        assert stats[k] == pytest.approx(ref_stats[k], abs=1e-5), k
    # the last minibatch's gradients, then the weights after the step (synced into the HF model)
    assert max_diff(trainer.named_grads(), ref_grads) < 1e-5
    assert max_diff(hf_weights(model), ref_after) < 1e-5


def test_state_dict_resumes_exactly():
    cfg, b1, b2 = trainer_cfg(), batch(seed=1), batch(seed=2)
    a = MegatronTrainer(hf_model("qwen3"), cfg, 0.8, 10)
    a.step(b1, 1)
    state = a.state_dict()
    a.step(b2, 2)
    model = hf_model("qwen3", seed=5)  # other weights: the state must bring them
    c = MegatronTrainer(model, cfg, 0.8, 10)
    c.load_state_dict(state)
    c.step(b2, 2)
    assert max_diff(c.named_masters(), a.named_masters()) == 0.0
    assert max_diff(hf_weights(model), a.named_masters()) == 0.0
    with pytest.raises(ValueError, match="not a megatron trainer state"):
        c.load_state_dict({"optimizer": {}, "scheduler": {}})
    assert c.adopt_moments(state["moments"]) == len(state["moments"])  # run.py's continue_warm_start
    with pytest.raises(KeyError, match="moments lack 1 parameters"):
        c.adopt_moments({n: m for n, m in state["moments"].items() if n != "model.norm.weight"})


# --------------------------------------------------------------------------- 2 gloo processes


def run_two_ranks(case: str, tmp_path) -> dict:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, case, str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
    found = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    return {k: v for f in found if f.exists() for k, v in json.loads(f.read_text()).items()}


# the two tests that start two gloo ranks run nightly (about 22 s each on a 2-core EPYC); this
# module's in-process tests (the mapping at every TP degree, a step against the torch trainer,
# resume) run in make test
@pytest.mark.nightly
def test_a_released_follower_leaves_its_process_groups_before_it_exits(tmp_path):
    """A follower process leaves gloo's group once rank 0 releases it (and exits 0): with the group
    alive at exit, gloo's worker threads meet interpreter finalization, which can abort the process."""
    r = run_two_ranks("leave", tmp_path)
    assert r == {"commands": 0, "initialized_after": False, "model_parallel_after": False}


@pytest.mark.slow
@pytest.mark.nightly
def test_tensor_and_data_parallel_on_two_processes(tmp_path):
    r = run_two_ranks("parallel", tmp_path)
    print(json.dumps(r, indent=1))
    # TP 2: the mapping against HF's logits, with the negative control
    for kind in ("qwen2", "llama", "qwen3"):
        assert r[f"tp2_logits_{kind}"] <= 1e-5, kind
        assert r[f"tp2_swapped_{kind}"] > 1e-2, kind  # swapping gate/up must fail the check
        assert r[f"tp2_gathered_{kind}"] == 0.0, kind  # gathered shards are the HF weights bit for bit
    # a step with TP 2 (rank 0 drives, rank 1 follows) and with DP 2 equals the torch trainer's
    for layout in ("tp2", "dp2"):
        assert r[f"{layout}_loss"] <= 1e-5, layout
        assert r[f"{layout}_grads"] <= 1e-5, layout
        assert r[f"{layout}_weights"] <= 1e-5, layout
        assert r[f"{layout}_grad_norm"] <= 1e-6, layout  # sharded squares summed, replicated ones once
    assert r["dp2_forward_passes"] >= 2  # both ranks trained
    assert r["dp2_unreduced_grads"] > 1e-3  # finalize_model_grads is what makes DP 2 right
    assert r["resume_tp2_as_dp2"] <= 1e-5  # the state is keyed by HF names: any layout resumes it
    assert r["follower_commands"] >= 4
    assert r["rejected_follow"] == 0  # a model rank 0 rejects releases the follower at once


def _worker(case: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if case == "leave":
        return _leave(out_dir)
    rank = int(os.environ["RANK"])
    res: dict = {}
    assert case == "parallel"
    # TP 2, module by module
    layout = parallel.init_parallel(2)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    for kind in ("qwen2", "llama", "qwen3"):
        model = hf_model(kind)
        arch, w = mapping.arch_of(model.config, 2), hf_weights(model)
        with torch.no_grad():
            ref = model(ids).logits
        res[f"tp2_logits_{kind}"] = float((megatron_logits(arch, w, 2, layout.tp_rank, ids) - ref).abs().max())
        bad = megatron_logits(arch, swap_gate_up(w), 2, layout.tp_rank, ids)
        res[f"tp2_swapped_{kind}"] = float((bad - ref).abs().max())
        local = mapping.hf_to_megatron(w, arch, 2, layout.tp_rank)
        back = mapping.megatron_to_hf(parallel.gather_tp(local, layout), arch)
        res[f"tp2_gathered_{kind}"] = max_diff(back, w)
    # a trainer step: TP 2, then DP 2, then DP 2 without the gradient all-reduce (megatron's groups
    # rebuilt in the same processes; rank 0 drives, rank 1 follows)
    from megatron.core import parallel_state as ps

    from areal_core.trainer.megatron.follower import follow

    cfg, b = trainer_cfg(ppo_minibatches=2), batch()
    bad = hf_model("qwen2")  # a model rank 0 rejects: it raises, and its follower is released
    bad.config.hidden_act = "gelu"
    if rank == 0:
        with pytest.raises(NotImplementedError, match="hidden_act 'gelu'"):
            MegatronTrainer(bad, cfg, temperature=0.8, total_steps=10, tp_size=2)
    else:
        res["rejected_follow"] = follow(2)
    for name, tp in (("tp2", 2), ("dp2", 1), ("dp2_unreduced", 1)):
        ps.destroy_model_parallel()
        if name == "dp2_unreduced":  # negative control: without the hook the ranks' gradients are not summed
            shims.finalize_model_grads = lambda *args, **kwargs: None
        if rank == 0:
            ref_stats, ref_grads, ref_after = torch_reference(hf_model("qwen2"), cfg, b)
            model = hf_model("qwen2")
            trainer = MegatronTrainer(model, cfg, temperature=0.8, total_steps=10, tp_size=tp)
            stats = trainer.step(b, version=1).metrics
            res[f"{name}_loss"] = abs(stats["loss"] - ref_stats["loss"])
            res[f"{name}_grads"] = max_diff(trainer.named_grads(), ref_grads)
            res[f"{name}_weights"] = max_diff(hf_weights(model), ref_after)
            res[f"{name}_forward_passes"] = stats["forward_passes"]
            res[f"{name}_grad_norm"] = abs(stats["grad_norm"] - ref_stats["grad_norm"]) / ref_stats["grad_norm"]
            if name == "tp2":  # resume: the TP 2 state, loaded with DP 2, continues the same way
                state = trainer.state_dict()
                trainer.step(batch(seed=4), version=2)
                continued = trainer.named_masters()
            elif name == "dp2":
                trainer.load_state_dict(state)
                trainer.step(batch(seed=4), version=2)
                res["resume_tp2_as_dp2"] = max_diff(trainer.named_masters(), continued)
            trainer.close()
        else:
            res["follower_commands"] = res.get("follower_commands", 0) + follow(tp)
    both = [None, None]  # rank 1 reports how many commands it followed
    torch.distributed.all_gather_object(both, res)
    if rank == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump({**both[0], **both[1]}, f)
    parallel.shutdown()


def _leave(out_dir: str) -> None:
    """Rank 0 releases rank 1 at once (as when it rejects the model); rank 1 reports what is left."""
    from megatron.core import parallel_state as ps

    from areal_core.trainer.megatron.follower import follow_then_leave

    if int(os.environ["RANK"]) == 0:
        parallel.init_parallel(2)
        parallel.send_command("stop")
        parallel.shutdown()
        return
    n = follow_then_leave(2)
    res = {
        "commands": n,
        "initialized_after": torch.distributed.is_initialized(),
        "model_parallel_after": ps.model_parallel_is_initialized(),
    }
    with open(os.path.join(out_dir, "rank1.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
