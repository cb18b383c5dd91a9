"""Shared-prefix (tree) training on ctxrl's workloads: tokens and estimated FLOPs with and without sharing, and a
CPU timing of the tiny model, padded against tree-packed.

    .venv/bin/python benchmarks/shared_prefix.py            # the table and the CPU timing
    .venv/bin/python benchmarks/shared_prefix.py --smoke    # a few rows, one repetition: does it run?
    python benchmarks/shared_prefix.py --device cuda        # Learner.update on a card, sharing off against auto

Where the rows come from (no model samples anything: every row is a scripted episode played through the real
agent loop, tokenized by the tiny model's tokenizer and ChatML-like template, so token counts are the tiny
tokenizer's, not Qwen's; the structure, what is shared and where rows part, is the real one):

- ``grpo/train_step``: ``benchmarks/train_step.py``'s workload, one group: a 128-token prompt and 8 completions
  of 256 tokens (random ids; the completions part at their first token);
- ``grpo/fact_hunt``: a group of 8 on fact_hunt: one task's rendered prompt, then the post-prompt tokens (tool
  calls, pages read, the answer) of the scripted solutions of 8 tasks, as 8 sampled completions would be;
- ``meta/minesweeper``: 8 trials (8 tasks) of 3 attempts with ``meta.carry = "attempts"``, scripted as a failed
  attempt, a reflection, another failure and reflection, then the solution; attempt ``k``'s row is the opening
  plus attempts ``1..k-1`` in full, then its own turns (``ctxrl.meta.rollout``);
- ``summarize/fact_hunt``: 8 fact_hunt episodes (8 tasks of the 6-to-8-page ``ood`` split) under
  ``context.manager = summarize`` with a 512-token budget and the environment's scripted summaries; every
  segment of an episode is a row.

The meta and summarize batches share only within a trial or an episode (8 different tasks), which understates
a real group, whose 8 trials or episodes of one task also share their opening.

FLOPs (``ctxrl.learner.shared_prefix.plan``) are forward + backward matrix products for the Qwen2.5 0.5B and 1.5B
shapes (``ctxrl.models.shapes``: parameters from the configurations, no weights): ``unshared`` is each row alone
with causal attention (the flat pass), ``dense`` the packed trees through SDPA with their 4D mask (what is built:
all ``L^2`` scores of a packed tree), ``tree`` a kernel scoring only the pairs a token attends. Rows are cut into
trees by ``group_rows`` (neighbours sharing 32 tokens, at most ``--max-tokens`` a tree) and every tree is
counted shared, whatever the plan says; the plan's verdict is its own column, and ``card`` is what
``train.shared_prefix = auto`` shares on a card, where a tree must save ``TREE_COST_ON_FLAT`` times its FLOPs.

The CPU timing runs the tiny model (float32, one thread) over each workload's rows: the padded batch (one
``token_logprobs`` call) against the trees (one ``tree_logprobs`` call a tree), forward and backward of the
same masked loss, median of ``--repeats``, alternating the two so that neither gets a warmer machine.

Last, the learner itself: ``Learner.update`` on each GRPO group (one mini-batch, so the group stays whole; old
log-probs recomputed, so the update's two passes both share) with ``train.shared_prefix`` ``off`` and ``auto``,
alternating, median of ``--repeats``: what a run gains, plan, packing and optimiser step included.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time

import torch

from ctxrl.learner.shared_prefix import ModelShape, pack_tree, plan_batch
from ctxrl.learner.shared_prefix.layout import tree_logprobs
from ctxrl.learner.shared_prefix.plan import KERNELS, TREE_COST_ON_FLAT, unshared_cost

TINY = "tiny:pretrain_steps=0"
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
MIN_SHARED = 32


# -- rows of the workloads --------------------------------------------------------------------------


def _prompt_end(mask: list[int]) -> int:
    return next((i for i, m in enumerate(mask) if m), len(mask))


def train_step_group(vocab: int, prompt: int = 128, completion: int = 256, n: int = 8, seed: int = 0):
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(prompt)]
    rows = [head + [rng.randrange(3, vocab) for _ in range(completion)] for _ in range(n)]
    return rows, [[0] * prompt + [1] * completion for _ in range(n)]


def _limits(**context):
    from ctxrl.rollout.managers import ContextPolicy
    from ctxrl.rollout.spec import RolloutLimits

    return RolloutLimits(max_turns=16, max_new_tokens=256, max_total_tokens=1 << 16,
                         context=ContextPolicy(**context) if context else ContextPolicy())


def fact_hunt_group(renderer, n: int = 8, seed: int = 0):
    from ctxrl.demos.play import play_script
    from ctxrl.envs.fact_hunt import FactHuntEnv

    tasks = FactHuntEnv.sample_tasks("train", n, seed)

    async def play():
        return await asyncio.gather(*(play_script(FactHuntEnv, t, FactHuntEnv.solve(t), renderer, _limits())
                                      for t in tasks))

    episodes = asyncio.run(play())
    start = _prompt_end(episodes[0].loss_mask)
    prompt = episodes[0].input_ids[:start]
    rows, masks = [], []
    for e in episodes:
        own = _prompt_end(e.loss_mask)
        rows.append(prompt + e.input_ids[own:])
        masks.append([0] * start + e.loss_mask[own:])
    return rows, masks


def minesweeper_trials(renderer, n: int = 8, attempts: int = 3, seed: int = 0):
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.envs.minesweeper import MinesweeperEnv
    from ctxrl.envs.recorded import RecordedEnv
    from ctxrl.meta.rollout import run_trial
    from ctxrl.sections import MetaConfig

    policy = MetaConfig(num_attempts=attempts, carry="attempts", reflect=True, reflection_max_tokens=256)

    def play(task):
        played: list[RecordedEnv] = []

        def make_env():
            played.append(RecordedEnv(MinesweeperEnv()))
            return played[-1]

        script = [*MinesweeperEnv.failure(task) * (attempts - 1), *MinesweeperEnv.solve(task)]
        engine = ScriptedEngine(script, renderer,
                                reflection=lambda: MinesweeperEnv.reflection(task, played[-1].messages))
        return run_trial(make_env, task, engine, renderer, _limits(), policy, seed=seed)

    async def play_all():
        return await asyncio.gather(*(play(t) for t in MinesweeperEnv.sample_tasks("train", n, seed)))

    attempts = [s for trial in asyncio.run(play_all()) for s in trial.sequences()]
    return [s.input_ids for s in attempts], [s.loss_mask for s in attempts]


def summarize_episodes(renderer, n: int = 8, budget: int = 512, seed: int = 0):
    from ctxrl.demos.play import play_script
    from ctxrl.envs.fact_hunt import FactHuntEnv
    from ctxrl.rollout.managers import get_manager

    limits = _limits(manager="summarize", max_context_tokens=budget, options={"max_summaries": 8, "max_tokens": 64})
    limits = dataclasses.replace(limits, max_new_tokens=48)
    solution = get_manager("summarize").demo_solution(FactHuntEnv) or FactHuntEnv.solve
    tasks = FactHuntEnv.sample_tasks("ood", n, seed)  # the out-of-distribution trails: 6 to 8 pages

    async def play():
        return await asyncio.gather(*(play_script(FactHuntEnv, t, solution(t), renderer, limits) for t in tasks))

    episodes = asyncio.run(play())
    if any(e.truncation is not None for e in episodes):
        raise RuntimeError(f"a scripted summarize episode ended early: {[e.truncation for e in episodes]}")
    segments = [s for e in episodes for s in e.sequences()]
    return [s.input_ids for s in segments], [s.loss_mask for s in segments]


# -- figures ----------------------------------------------------------------------------------------


def _planned(plans) -> tuple[int, float]:
    """Tokens and FLOPs of a batch run as planned: each tree shared if its plan says so, else its rows alone."""
    chosen = [plan.shared if plan.share else plan.unshared for _, plan in plans]
    return sum(c.tokens for c in chosen), sum(c.flops for c in chosen)


def flop_row(name: str, rows, shape: ModelShape, max_tokens: int) -> dict:
    """One workload on one shape: unshared, and as the plan cuts and shares it under each attention kernel."""
    unshared = unshared_cost(shape, [len(r) for r in rows])
    out = {"workload": name, "shape": shape.name, "rows": len(rows), "tokens": unshared.tokens,
           "flops": unshared.flops}
    for kernel in KERNELS:
        plans = plan_batch(rows, shape, min_shared_tokens=MIN_SHARED, max_tokens=max_tokens, kernel=kernel)
        out[f"{kernel}_tokens"], out[f"{kernel}_flops"] = _planned(plans)
        out[f"{kernel}_trees"] = f"{sum(p.share for _, p in plans)}/{len(plans)}"
    card = plan_batch(rows, shape, min_shared_tokens=MIN_SHARED, max_tokens=max_tokens, kernel="tree",
                      cost_factor=TREE_COST_ON_FLAT)  # what train.shared_prefix=auto shares on a card
    out["card_trees"] = f"{sum(p.share for _, p in card)}/{len(card)}"
    return out


def print_flops(table: list[dict]) -> None:
    print(f"{'workload':<20} {'shape':<13} {'rows':>4} {'tokens':>7} | {'dense plan: tokens':>18} {'x':>5} "
          f"{'TFLOP':>7} {'/ TFLOP':>7} {'x':>5} {'shared':>6} | {'tree kernel: tokens':>19} {'x':>5} {'TFLOP':>7} "
          f"{'x':>5} | {'card':>5}")
    for r in table:
        print(f"{r['workload']:<20} {r['shape']:<13} {r['rows']:>4} {r['tokens']:>7} | {r['dense_tokens']:>18} "
              f"{r['tokens'] / r['dense_tokens']:>5.2f} {r['dense_flops'] / 1e12:>7.2f} {r['flops'] / 1e12:>7.2f} "
              f"{r['flops'] / r['dense_flops']:>5.2f} {r['dense_trees']:>6} | {r['tree_tokens']:>19} "
              f"{r['tokens'] / r['tree_tokens']:>5.2f} {r['tree_flops'] / 1e12:>7.2f} "
              f"{r['flops'] / r['tree_flops']:>5.2f} | {r['card_trees']:>5}")


def time_rows(model, rows, masks, plans: dict[str, list], repeats: int) -> dict[str, float]:
    """Median seconds of forward + backward of the same masked log-prob sum: the padded batch (``padded``), and for
    each of ``plans`` (name: ``plan_batch``'s trees) its shared trees packed (one ``tree_logprobs`` call each) and
    its other rows padded (one ``token_logprobs`` call). The arms alternate, a warm-up round first."""
    from ctxrl.learner.logprobs import token_logprobs

    def padded_loss(index: list[int]):
        width = max(len(rows[r]) for r in index)
        ids = torch.zeros((len(index), width), dtype=torch.long)
        mask = torch.zeros((len(index), width - 1))
        attention = torch.zeros((len(index), width), dtype=torch.long)
        for k, r in enumerate(index):
            ids[k, : len(rows[r])] = torch.tensor(rows[r])
            attention[k, : len(rows[r])] = 1
            mask[k, : len(rows[r]) - 1] = torch.tensor(masks[r][1:], dtype=torch.float32)
        return (token_logprobs(model, ids, attention, mask=mask) * mask).sum()

    def arm(planned):
        def run():
            alone = [r for group, plan in planned if not plan.share for r in group]
            if alone:
                padded_loss(alone).backward()
            for group, plan in planned:
                if plan.share:
                    packed = pack_tree([rows[r] for r in group], [masks[r] for r in group])
                    tree_logprobs(model, packed).sum().backward()
        return run

    arms = {"padded": lambda: padded_loss(list(range(len(rows)))).backward(), **{k: arm(v) for k, v in plans.items()}}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(repeats + 1):
        for key, fn in arms.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def time_updates(model, rows, masks, repeats: int, micro_batch_tokens: int = 0) -> dict[str, float]:
    """Median seconds of one ``Learner.update`` of ``rows`` (a GRPO group: random advantages of mean 0, behaviour
    log-probs 0) with ``train.shared_prefix`` off and auto, alternating after a warm-up round, and the rows the
    shared update ran in trees. Plain SGD at learning rate 0: every repetition sees the same weights. On CUDA the
    clock waits for the card, and each arm's peak memory (GiB) is recorded; ``micro_batch_tokens`` is the
    micro-batch budget (0: rows at a time)."""
    from ctxrl.learner.batch import collate
    from ctxrl.learner.learner import Learner
    from ctxrl.learner.settings import LearnerSettings
    from ctxrl.sections import AlgoConfig, TrainConfig
    from ctxrl.types import TrainSequence

    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(len(rows), generator=g)
    advantages = (advantages - advantages.mean()).tolist()
    batch = collate([TrainSequence(input_ids=r, loss_mask=m, behavior_logprobs=[0.0] * len(r),
                                   advantages=[a * x for x in m]) for r, m, a in zip(rows, masks, advantages)], 0)
    cuda = next(model.parameters()).is_cuda
    learners = {mode: Learner(model, torch.optim.SGD(model.parameters(), lr=0.0),
                              LearnerSettings(algo=AlgoConfig(old_logprobs="recompute"),
                                              train=TrainConfig(mini_batches=1, shared_prefix=mode),
                                              micro_batch_tokens=micro_batch_tokens), pad_token_id=0)
                for mode in ("off", "auto")}
    times: dict[str, list[float]] = {k: [] for k in learners}
    peaks: dict[str, float] = {}
    shared = 0.0
    for _ in range(repeats + 1):
        for mode, learner in learners.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            metrics = learner.update(batch)
            if cuda:
                torch.cuda.synchronize()
                peaks[f"{mode}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            times[mode].append(time.perf_counter() - start)
            shared = metrics["learner_shared_prefix_rows"] if mode == "auto" else shared
    return {**{k: statistics.median(v[1:]) for k, v in times.items()}, "shared_rows": shared, **peaks}


def _padded_batch(rows, masks, advantages, device):
    """Right-padded ids, attention and the loss's weights (advantage x shifted loss mask) of ``rows``."""
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    weights = torch.zeros((len(rows), width - 1))
    for r, (row, mask) in enumerate(zip(rows, masks)):
        ids[r, : len(row)] = torch.tensor(row)
        attention[r, : len(row)] = 1
        weights[r, : len(row) - 1] = torch.tensor(mask[1:], dtype=torch.float32) * advantages[r]
    return ids.to(device), attention.to(device), weights.to(device)


def _logprobs_and_grads(model, kernel: str, rows, masks, padded, device):
    """The loss's log-probs and every parameter's gradient, the rows padded (``kernel = "padded"``) or as one tree."""
    from ctxrl.learner.logprobs import token_logprobs, tree_token_logprobs

    ids, attention, weights = padded
    model.zero_grad(set_to_none=True)
    if kernel == "padded":
        logprobs = token_logprobs(model, ids, attention, mask=(weights != 0).float(), chunk=1024)
    else:
        packed = pack_tree(rows, masks, device=device, kernel=kernel)
        logprobs = packed.unpack(tree_token_logprobs(model, packed, chunk=1024))
    (logprobs * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach() * (weights != 0), grads


def check_exact(data: dict, shape: str, device: str) -> dict:
    """The tree passes against the padded rows on ``device``, a random-init ``shape`` model in float32 (TF32 off):
    per workload, the largest log-prob difference and each parameter's gradient difference relative to its norm
    (the largest over parameters) for the dense mask and for FlexAttention. What the CPU tests cannot show: on a
    CPU FlexAttention has no backward pass."""
    from ctxrl.models.shapes import random_model

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = random_model(shape, torch.float32, device).train()
    model.config._attn_implementation = "sdpa"
    print(f"\n{device}: exactness, a random-init {shape} in float32, padded rows against each tree kernel "
          "(largest |delta log p|; largest relative gradient difference over parameters)")
    out = {}
    for name, (rows, masks) in data.items():
        advantages = torch.randn(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
        padded = _padded_batch(rows, masks, advantages, device)
        if not bool(padded[2].any()):  # (no token to train on: a smoke run's cut rows)
            continue
        base_lp, base_grads = _logprobs_and_grads(model, "padded", rows, masks, padded, device)
        row = {}
        for kernel in ("dense", "flex"):
            lp, grads = _logprobs_and_grads(model, kernel, rows, masks, padded, device)
            rel = max(float((grads[n] - base_grads[n]).norm() / base_grads[n].norm().clamp(min=1e-30))
                      for n in base_grads)
            row[kernel] = {"logprob": float((lp - base_lp).abs().max()), "grad_rel": rel}
        out[name] = row
        print(f"  {name:<20} dense: {row['dense']['logprob']:.2e} / {row['dense']['grad_rel']:.2e}   "
              f"flex: {row['flex']['logprob']:.2e} / {row['flex']['grad_rel']:.2e}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return out


def device_updates(data: dict, shape: str, device: str, repeats: int, micro_batch_tokens: int) -> dict:
    """``time_updates`` for every workload on a random-init model of ``shape`` (bf16, SDPA) on ``device``: what a
    run on a card gains from ``train.shared_prefix = "auto"`` (off: the flat pass where it runs; auto: HF's pass,
    the shared trees with their ancestor mask)."""
    from ctxrl.models.shapes import random_model

    model = random_model(shape, torch.bfloat16, device).train()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    model.config._attn_implementation = "sdpa"
    print(f"\n{device}: Learner.update of each workload, a random-init {shape} (bf16), one mini-batch, old log-probs "
          f"recomputed, micro-batches of {micro_batch_tokens or 'rows'} tokens, train.shared_prefix off against auto, "
          f"median of {repeats}")
    out = {}
    for name, (rows, masks) in data.items():
        seconds = out[name] = time_updates(model, rows, masks, repeats, micro_batch_tokens)
        peak = (f"   peak {seconds['off_peak_gib']:.1f} / {seconds['auto_peak_gib']:.1f} GiB"
                if "off_peak_gib" in seconds else "")
        print(f"  {name:<20} {sum(map(len, rows)):>6} tokens   off {seconds['off'] * 1e3:8.1f} ms   auto "
              f"{seconds['auto'] * 1e3:8.1f} ms ({seconds['off'] / seconds['auto']:4.2f}x, "
              f"{seconds['shared_rows']:.0f} of {len(rows)} rows shared){peak}")
    return out


def workloads(renderer, vocab: int, smoke: bool) -> dict:
    """Each workload's rows and loss masks; ``smoke``: 2 groups, trials or episodes, each row cut to 160 tokens."""
    n = 2 if smoke else 8
    data = {"grpo/train_step": train_step_group(vocab, *((40, 24, n) if smoke else ())),
            "grpo/fact_hunt": fact_hunt_group(renderer, n),
            "meta/minesweeper": minesweeper_trials(renderer, n),
            "summarize/fact_hunt": summarize_episodes(renderer, n)}
    if smoke:
        data = {k: ([r[:160] for r in rows], [m[:160] for m in masks]) for k, (rows, masks) in data.items()}
    return data


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few short rows, one repetition: does it run?")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions of each CPU arm (their median)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="most tokens a packed tree holds")
    ap.add_argument("--device", default="", help="also time Learner.update of every workload on this device "
                    "(cuda) with a random-init --shape model; the CPU timings are left out then")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="the random-init models --device times (comma-separated)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="--device's micro-batch budget")
    ap.add_argument("--check", action="store_true", help="with --device: first the tree kernels' log-probs and "
                    "gradients against the padded rows (float32)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import Qwen2Config

    from ctxrl.chat.render import ChatRenderer
    from ctxrl.models.loader import load_model, load_tokenizer
    from ctxrl.models.shapes import SHAPES as CONFIGS
    from ctxrl.train.tiny import ensure_model

    path = ensure_model(TINY)
    model = load_model(path, dtype="float32", device="cpu").train()
    data = workloads(ChatRenderer(load_tokenizer(path), template_name="tiny"), model.config.vocab_size, args.smoke)
    shapes = [ModelShape.from_config(Qwen2Config(**CONFIGS[s]), s) for s in SHAPES]
    table = [flop_row(name, rows, shape, args.max_tokens) for shape in shapes for name, (rows, _) in data.items()]
    print("Training FLOPs (forward + backward), unshared against as planned; x: unshared / shared")
    print_flops(table)
    repeats = 1 if args.smoke else args.repeats
    if args.device:
        checked = check_exact(data, args.shape.split(",")[0], args.device) if args.check else None
        return {"flops": table, "check": checked, "device": {shape: device_updates(data, shape, args.device, repeats,
                                                                 args.micro_batch_tokens)
                                           for shape in args.shape.split(",")}}
    tiny = ModelShape.from_config(model.config, "tiny")
    print(f"\nCPU, the tiny model ({tiny.matmul_params:,} parameters, float32, 1 thread), forward + backward, median "
          f"of {repeats}; tree: every tree the tree-kernel plan finds, packed; planned: the dense plan for the tiny "
          "shape (its unshared rows padded)")
    timing = {}
    for name, (rows, masks) in data.items():
        plans = {kernel: plan_batch(rows, tiny, min_shared_tokens=MIN_SHARED, max_tokens=args.max_tokens,
                                    kernel=kernel) for kernel in KERNELS}
        seconds = time_rows(model, rows, masks, {"tree": plans["tree"], "planned": plans["dense"]}, repeats)
        timing[name] = seconds
        print(f"  {name:<20} padded {seconds['padded'] * 1e3:8.1f} ms   tree {seconds['tree'] * 1e3:8.1f} ms "
              f"({seconds['padded'] / seconds['tree']:4.2f}x)   planned {seconds['planned'] * 1e3:8.1f} ms "
              f"({seconds['padded'] / seconds['planned']:4.2f}x, {sum(p.share for _, p in plans['dense'])} of "
              f"{len(plans['dense'])} trees shared)")
    print(f"\nCPU, Learner.update of one GRPO group (the tiny model, one mini-batch, old log-probs recomputed), "
          f"train.shared_prefix off against auto, median of {repeats}")
    updates = {}
    for name in ("grpo/train_step", "grpo/fact_hunt"):
        rows, masks = data[name]
        seconds = updates[name] = time_updates(model, rows, masks, repeats)
        print(f"  {name:<20} off {seconds['off'] * 1e3:8.1f} ms   auto {seconds['auto'] * 1e3:8.1f} ms "
              f"({seconds['off'] / seconds['auto']:4.2f}x, {seconds['shared_rows']:.0f} of {len(rows)} rows shared)")
    return {"flops": table, "cpu": timing, "learner": updates}


if __name__ == "__main__":
    main()
