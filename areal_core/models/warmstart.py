"""Supervised warm start of the tiny model on reference solutions, and its cache.

The loss covers the solution and the EOS that ends it, never the prompt, so the
model learns to answer prompts it is given (what RL will ask it to do).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tqdm.auto import tqdm

from areal_core.models.config import TinyArch, WarmStart

log = logging.getLogger(__name__)

IGNORE = -100
FINAL_LR_FRACTION = 0.1  # linear decay from cfg.lr to 10% of it
STATS_FILE = "warmstart_stats.json"
MOMENTS_FILE = "optimizer_moments.pt"  # AdamW state per parameter name, for RL to continue from
CACHE_LAYOUT = 3  # bump when the cache folder's contents change


def _encode_pairs(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    if tokenizer.eos_token_id is None:
        raise ValueError("warm start needs a tokenizer with an EOS token")
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    answers = tokenizer([s for _, s in pairs], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(list(p), list(s) + [eos]) for p, s in zip(prompts, answers)]


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels are the token ids on the answer, IGNORE elsewhere."""
    width = max(len(p) + len(s) for p, s in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    for row, (p, s) in enumerate(encoded):
        n = len(p) + len(s)
        ids[row, :n] = torch.tensor(p + s)
        mask[row, :n] = 1
        labels[row, len(p) : n] = torch.tensor(s)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy over the labelled (answer) tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE
    )


@torch.no_grad()
def greedy_exact_match(model, encoded: list[tuple[list[int], list[int]]], pad_id: int, chunk: int = 128) -> float:
    """Share of (prompt, answer) pairs that greedy decoding reproduces exactly, EOS included.

    Greedy decoding writes the reference iff at every answer position the argmax of the
    next-token distribution, given the prompt and the reference so far, is the reference's
    token: one teacher-forced forward pass checks that, with no generation.
    """
    was_training = model.training
    model.eval()
    hits = 0
    for i in range(0, len(encoded), chunk):
        batch = collate(encoded[i : i + chunk], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        right = (logits[:, :-1].argmax(-1) == targets) | (targets == IGNORE)
        hits += int(right.all(dim=1).sum())
    model.train(was_training)
    return hits / len(encoded)


def warm_start(
    model,
    tokenizer,
    pairs: list[tuple[str, str]],
    cfg: WarmStart,
    seed: int,
    progress: bool = True,
    weights: list[float] | None = None,
    val_pairs: list[tuple[str, str]] | None = None,
    on_check: Callable[[int, torch.nn.Module], bool] | None = None,
    extra_steps: int = 0,
    resume_at: int = 0,
    moments: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict:
    """Fine-tune ``model`` in place on (prompt, solution) pairs; return stats.

    AdamW at ``cfg.lr`` decaying linearly to 10% of it over ``cfg.steps``
    steps of ``cfg.batch_size`` pairs drawn at random (seeded) from ``pairs``,
    with probability proportional to ``weights`` when given. With
    ``cfg.stop_at_accuracy``, training stops at the first check (every
    ``cfg.check_every`` steps) where the greedy exact-match rate on ``val_pairs``
    reaches it; the stats record every check (``val_curve``). ``on_check(step, model)``,
    when given, is called at every check too; it returning True stops training.
    ``extra_steps`` more steps may follow the schedule, at its final lr (to continue the
    same recipe for longer, e.g. for as long as RL ran). ``resume_at`` with ``moments``
    (the stats' ``optimizer_moments`` of a warm start that stopped after ``resume_at``
    steps, ``model`` its result) goes on from there: the same draws, lr and AdamW state
    as if it had never stopped.
    """
    if cfg.stop_at_accuracy is not None and not val_pairs:
        raise ValueError("model.warm_start.stop_at_accuracy needs validation pairs to check accuracy on")
    if not pairs:
        raise ValueError("warm start needs at least one (prompt, solution) pair")
    if weights is not None and len(weights) != len(pairs):
        raise ValueError(f"warm start got {len(weights)} weights for {len(pairs)} pairs")
    if tokenizer.pad_token_id is None:
        raise ValueError("warm start needs a tokenizer with a pad token")
    encoded = _encode_pairs(tokenizer, pairs)
    # sorted by length, so each chunk of the check pads little
    val = (
        sorted(_encode_pairs(tokenizer, val_pairs), key=lambda e: len(e[0]) + len(e[1]))
        if cfg.stop_at_accuracy is not None
        else []
    )
    val_curve: list[tuple[int, float]] = []
    rng = random.Random(f"warmstart-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    span = max(cfg.steps - 1, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - (1.0 - FINAL_LR_FRACTION) * min(i, span) / span)
    if resume_at:
        if moments is None:
            raise ValueError("warm start: resume_at needs the stopped warm start's optimizer moments")
        by_name = dict(model.named_parameters())
        for name, st in moments.items():
            opt.state[by_name[name]] = {k: v.clone() for k, v in st.items()}
        with warnings.catch_warnings():  # lr steps with no optimizer step: replayed, on purpose
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(resume_at):  # the draws and lr steps the stopped warm start made
                rng.choices(encoded, weights=weights, k=cfg.batch_size)
                sched.step()
    losses: list[float] = []
    n_tokens = 0
    t0 = time.perf_counter()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bar = tqdm(range(resume_at, cfg.steps + extra_steps), desc="warm start", disable=not progress, mininterval=1.0)
        for step in bar:
            batch = collate(rng.choices(encoded, weights=weights, k=cfg.batch_size), tokenizer.pad_token_id)
            loss = sft_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            n_tokens += int((batch["labels"] != IGNORE).sum())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            if (val or on_check) and (step + 1) % cfg.check_every == 0:
                stop = False
                if val:
                    val_curve.append((step + 1, greedy_exact_match(model, val, tokenizer.pad_token_id)))
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", val_acc=f"{val_curve[-1][1]:.3f}", refresh=False)
                    stop = val_curve[-1][1] >= cfg.stop_at_accuracy
                if on_check is not None:
                    stop = on_check(step + 1, model) or stop
                if stop:
                    break
        bar.close()
    model.eval()
    if val and (not val_curve or val_curve[-1][1] < cfg.stop_at_accuracy):
        log.warning(
            "warm start ran all %d steps without reaching validation accuracy %.3f (last %.3f): "
            "raise model.warm_start.steps",
            cfg.steps,
            cfg.stop_at_accuracy,
            val_curve[-1][1] if val_curve else float("nan"),
        )
    tail = losses[-min(10, len(losses)) :] if losses else []
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {names[id(p)]: {k: v.detach().clone() for k, v in st.items()} for p, st in opt.state.items()}
    return {
        "optimizer_moments": moments,
        "steps": len(losses),
        "val_curve": val_curve,
        "val_accuracy": val_curve[-1][1] if val_curve else None,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "losses": losses,
        "answer_tokens": n_tokens,
        "wall_s": time.perf_counter() - t0,
    }


def chain_length_weights(lengths: list[int], alpha: float) -> list[float]:
    """Per-example weights that turn the empirical chain-length mix into P(k) ~ k**-alpha.

    Weight of an example of length k: k**-alpha / (share of examples of length k),
    so sampling with these weights gives each length exactly its target share.
    """
    if not lengths:
        raise ValueError("no chain lengths to weight")
    counts: dict[int, int] = {}
    for k in lengths:
        if k < 1:
            raise ValueError(f"chain length must be >= 1, got {k}")
        counts[k] = counts.get(k, 0) + 1
    total = sum(k**-alpha for k in counts)
    return [(k**-alpha / total) / counts[k] for k in lengths]


def default_cache_dir() -> Path:
    """``$AREAL_FLOW_CACHE/warmstart`` if set, else ``~/.cache/areal-flow/warmstart``."""
    root = os.environ.get("AREAL_FLOW_CACHE") or os.path.join(Path.home(), ".cache", "areal-flow")
    return Path(root) / "warmstart"


def cache_key(
    arch: TinyArch,
    cfg: WarmStart,
    pairs: list[tuple[str, str]],
    seed: int,
    task: dict | None,
    weights: list[float] | None = None,
    val_pairs: list[tuple[str, str]] | None = None,
) -> str:
    """Hash of everything that determines the warmed-up weights.

    The pairs themselves are hashed (so any data set, not only the synthetic
    task, keys correctly); ``task`` (e.g. the synthetic task config) is kept in
    the key too, for readability of the stored key file.
    """
    data = hashlib.sha256()
    for p, s in pairs + [("<val>", "")] + list(val_pairs or []):
        data.update(p.encode())
        data.update(b"\x00")
        data.update(s.encode())
        data.update(b"\x01")
    key = {
        "arch": arch.model_dump(),
        "warm_start": cfg.model_dump(),
        "task": task,
        "pairs_sha256": data.hexdigest(),
        "weights_sha256": None if weights is None else hashlib.sha256(json.dumps(weights).encode()).hexdigest(),
        "seed": seed,
        "layout": CACHE_LAYOUT,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    return json.dumps(key, sort_keys=True)


def _load(folder: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    from areal_core.models.tokenizer import load_tokenizer

    return model, load_tokenizer(str(folder))


def cached_warm_start(
    arch: TinyArch,
    cfg: WarmStart,
    pairs: list[tuple[str, str]],
    seed: int,
    *,
    task: dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    weights: list[float] | None = None,
    val_pairs: list[tuple[str, str]] | None = None,
):
    """Build the tiny model and warm-start it, or load that result from the cache.

    Returns ``(model, tokenizer, info)``; ``info`` holds the warm-start stats,
    the path of the saved AdamW moments (``optimizer_moments``, see
    ``load_optimizer_moments``),
    the cache folder and whether it was a cache hit. The folder is written
    under a temp name and renamed into place, so a half-written entry is
    never loaded.
    """
    from areal_core.models.tiny import build_tiny
    from areal_core.models.tokenizer import build_char_tokenizer

    key = cache_key(arch, cfg, pairs, seed, task, weights, val_pairs)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = root / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (dest / STATS_FILE).is_file():
        model, tokenizer = _load(dest)
        stats = json.loads((dest / STATS_FILE).read_text())
        return (
            model,
            tokenizer,
            {**stats, "path": str(dest), "cached": True, "optimizer_moments": str(dest / MOMENTS_FILE)},
        )

    tokenizer = build_char_tokenizer()
    model = build_tiny(arch, tokenizer, seed)
    stats = warm_start(model, tokenizer, pairs, cfg, seed, progress=progress, weights=weights, val_pairs=val_pairs)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warmstart_key.json").write_text(key)
        torch.save(stats["optimizer_moments"], tmp / MOMENTS_FILE)
        (tmp / STATS_FILE).write_text(
            json.dumps({k: v for k, v in stats.items() if k not in ("losses", "optimizer_moments")})
        )
        try:
            os.rename(tmp, dest)
        except OSError:  # another process stored the same entry first; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stats.pop("losses")
    return (
        model,
        tokenizer,
        {**stats, "path": str(dest), "cached": False, "optimizer_moments": str(dest / MOMENTS_FILE)},
    )


def load_optimizer_moments(path: str | os.PathLike) -> dict[str, dict[str, torch.Tensor]]:
    """The warm start's AdamW state, keyed by parameter name (see ``Trainer.adopt_moments``)."""
    return torch.load(path, map_location="cpu", weights_only=True)
