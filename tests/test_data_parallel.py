"""The data-parallel learner (``ctxrl.distributed.data_parallel``): 2 processes over gloo on the CPU take exactly
the single-process update, with uneven token counts per rank, several mini-batches and micro-batches, recomputed
old log-probs, the sequence-mean aggregations, and a rank whose share of a mini-batch is empty."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import _scored_episodes  # (a plain function: the spawned ranks import this module too)

from ctxrl.distributed.data_parallel import DataParallel
from ctxrl.train.batch import collate
from ctxrl.train.learner import LAYOUT_KEYS, Learner, PPOSettings

EXAMPLE = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "calculator_tiny.toml"
LENGTHS = [12, 5, 9, 3, 14, 7, 4]  # 7 rows: shares of 3 and 4 rows, 26 and 28 tokens (test_shares_...)
CASES = {
    "token-mean": dict(agg="token-mean", mini_batches=2, micro_batch_size=2, old_logprobs="recompute"),
    "seq-mean": dict(agg="seq-mean-token-sum-norm", mini_batches=1, micro_batch_size=3),
    "one-row-mini-batches": dict(agg="token-mean", mini_batches=7, micro_batch_size=1, ppo_epochs=2),
    "entropy-and-tis": dict(agg="seq-mean-token-mean", mini_batches=2, entropy_coef=0.01, old_logprobs="recompute",
                            tis_cap=2.0),
}


def _model():
    from ctxrl.models.shapes import random_model

    return random_model("qwen2-test", torch.float64, "cpu", seed=0)


def _batch(vocab: int):
    return collate(_scored_episodes(vocab, LENGTHS, seed=4), 0, advantages=[1.0, -1.0, 0.5, -0.5, 2.0, 0.25, -1.5])


def _update(case: str, parallel=None):
    model = _model()
    # a parameter no forward pass uses: no rank has its gradient, so AdamW (with weight decay) must skip it on every
    # rank as it does in one process
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))
    settings = PPOSettings(logprob_chunk_tokens=4, flat_forward="off", **CASES[case])
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), settings,
                      pad_token_id=0, seed=5, parallel=parallel)
    metrics = learner.update(_batch(model.config.vocab_size))
    metrics["unused_after"] = model.unused.detach().tolist()
    return metrics, torch.cat([p.detach().flatten() for name, p in model.named_parameters() if name != "unused"])


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        parallel = DataParallel()
        results = {case: _update(case, parallel) for case in CASES}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    init = f"file://{tmp / 'rendezvous'}"
    mp.start_processes(_rank, args=(2, init, str(tmp / "result")), nprocs=2, join=True, start_method="spawn")
    return [torch.load(tmp / f"result.{r}") for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_take_exactly_the_single_process_update(two_ranks, case):
    want_metrics, want_weights = _update(case)
    before = torch.cat([p.detach().flatten() for p in _model().parameters()])
    assert not torch.allclose(want_weights, before) and want_metrics["unused_after"] == [1.0, 1.0, 1.0]
    for rank_metrics, rank_weights in (r[case] for r in two_ranks):
        torch.testing.assert_close(rank_weights, want_weights, atol=1e-10, rtol=1e-9)
        assert rank_metrics.pop("unused_after") == [1.0, 1.0, 1.0]  # no gradient anywhere: not decayed either
        for key, value in want_metrics.items():
            if key == "unused_after" or key in LAYOUT_KEYS:
                continue
            # recomputed old log-probs are kept as float32 per row (per_token_rows): a row computed in another
            # micro-batch may round differently there, which the TIS weights (exp of the difference) show
            rel = 1e-6 if key.startswith("tis_") else 1e-8
            assert rank_metrics[key] == pytest.approx(value, rel=rel, abs=1e-12), key
    assert torch.equal(two_ranks[0][case][1], two_ranks[1][case][1])  # both ranks hold the same weights


def test_shares_are_disjoint_balanced_and_uneven():
    class Fake(DataParallel):
        def __init__(self, rank: int, world: int) -> None:
            self.rank, self.world, self.group = rank, world, None

    shares = [Fake(r, 2).shard(LENGTHS) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(len(LENGTHS)))
    tokens = [sum(LENGTHS[i] for i in share) for share in shares]
    assert tokens == [26, 28] and [len(s) for s in shares] == [3, 4]  # uneven in rows and tokens
    assert Fake(1, 2).shard([5]) == [] and Fake(0, 2).shard([5]) == [0]  # a one-row mini-batch: rank 1 idle


def test_without_a_process_group_it_says_what_to_start(monkeypatch):
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "1")
    assert DataParallel.from_environment("cpu") is None
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        DataParallel()


def _closing_rank(rank: int, world: int, port: int, out: str) -> None:
    """Three ways to end: a group from_environment started (close destroys it), one the caller started (close
    leaves it), and a rank that never arrives (close gives up after its timeout and leaves the group)."""
    import time

    import torch.distributed as dist

    from ctxrl.distributed import data_parallel

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    seen = {}
    parallel = DataParallel.from_environment("cpu")
    seen["owned"] = parallel.owns_group
    seen["message"] = parallel.broadcast_object("from rank 0" if rank == 0 else None)
    parallel.close()
    seen["after_owned_close"] = dist.is_initialized()

    dist.init_process_group("gloo", init_method=f"file://{out}.rendezvous", rank=rank, world_size=world)
    parallel = DataParallel.from_environment("cpu")
    seen["caller_owned"] = parallel.owns_group
    parallel.close()
    seen["after_caller_close"] = dist.is_initialized()

    data_parallel.CLOSE_TIMEOUT_S = 2
    if rank == 0:
        parallel.close()  # rank 1 is not coming: a warning, not a hang or a teardown under its feet
        seen["after_timed_out_close"] = dist.is_initialized()
    else:
        time.sleep(4)
    torch.save(seen, f"{out}.{rank}")
    dist.destroy_process_group()


def test_close_waits_for_every_rank_and_destroys_only_the_group_it_started(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_closing_rank, args=(2, port, str(tmp_path / "r")), nprocs=2, join=True, start_method="spawn")
    seen = [torch.load(tmp_path / f"r.{rank}") for rank in range(2)]
    for rank in range(2):
        assert seen[rank]["owned"] and not seen[rank]["caller_owned"]
        assert seen[rank]["message"] == "from rank 0"
        assert seen[rank]["after_owned_close"] is False  # destroyed: a clean exit
        assert seen[rank]["after_caller_close"] is True  # the caller's group is the caller's to destroy
    assert seen[0]["after_timed_out_close"] is True


def test_a_copy_of_the_batch_is_what_every_rank_needs():
    # the learner selects its share itself: the same (whole) batch object goes to every rank
    batch = _batch(_model().config.vocab_size)
    assert copy.deepcopy(batch).lengths.tolist() == LENGTHS


@pytest.mark.slow  # (31-44 s: torchrun's two processes each build a run; the in-process two-rank tests above keep
# the update's equality with one process in the default run)
def test_ctxrl_train_under_torchrun_matches_one_process(tmp_path):
    """``torchrun -m ctxrl train`` with 2 gloo ranks: rank 0 warm-starts, collects and reports; both ranks update on
    their shares. Its first RL update equals the one-process run's (same episodes, same loss and gradient norm),
    and only rank 0 writes the run directory."""
    import json
    import subprocess
    import sys

    overrides = ["model.name=tiny:pretrain_steps=0", "sft.demos=8", "sft.epochs=1", "sft.batch_size=4",
                 "eval.tasks=2", "rollout.tasks_per_step=3", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "run.samples_per_step=0", "train.mini_batches=2", "train.micro_batch_size=2", "model.device=cpu",
                 "run.progress=false", "algo.entropy_coef=0.01"]  # (a gradient even when every reward is 0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for world in (1, 2):
        run_dir = tmp_path / f"world{world}"
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                    if world > 1 else [sys.executable])
        done = subprocess.run([*launcher, "-m", "ctxrl", "train", str(EXAMPLE), "--steps", "2", "--run-dir",
                               str(run_dir), *overrides], capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("success per split") == 1  # one table, from rank 0
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[world] = [r for r in rows if r.get("phase") == "rl"]
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 2
    assert two[0]["reward"] == one[0]["reward"]  # rank 0 played the same episodes
    assert one[0]["grad_norm"] > 0
    for key in ("loss", "grad_norm", "entropy"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-7), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["world1", "world2"]  # no directory from rank 1
