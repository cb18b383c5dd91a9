"""The ``Learner`` over sharded ranks (FSDP2, ``ctxrl.distributed.sharded.ShardedRanks``): its PPO update equals the
one-process update. Every forward and backward of a sharded model is a collective, so a rank with fewer
micro-batches than another runs idle ones (one row, every weight 0): in one process they must change nothing, and
over two gloo ranks the whole update must match, with a rank idle in every one-row mini-batch."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from conftest import _scored_episodes  # (plain functions: the spawned ranks import this module too)
from test_sharded import _model

from ctxrl.learner.batch import collate
from ctxrl.learner.learner import Learner, LearnerSettings
from ctxrl.sections import AlgoConfig, TrainConfig

LENGTHS = [12, 5, 9, 3, 14, 7, 4]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, 0.25, -1.5]
CASES = {  # ([algo], [train]) of each update
    "token-mean": (dict(agg="token-mean", old_logprobs="recompute"), dict(mini_batches=2, micro_batch_size=2)),
    "one-row-mini-batches": (dict(agg="seq-mean-token-mean"), dict(mini_batches=7, micro_batch_size=1, ppo_epochs=2)),
}


def _settings(case: str | None = None) -> LearnerSettings:
    algo, train = CASES[case] if case else ({}, {})
    return LearnerSettings(AlgoConfig(**algo), TrainConfig(logprob_chunk_tokens=0, flat_forward="off", **train))


class PaddedRanks:
    """One process posing as a sharded rank whose partner always ran two more micro-batches: the learner's own
    rows, then two idle passes after each set (recomputing old log-probs, and each mini-batch)."""

    sharded = True

    def __init__(self) -> None:
        self.asked = 0

    def shard(self, lengths):
        return list(range(len(lengths)))

    def most(self, count: int) -> int:
        self.asked += 1
        return count + 2

    def reduce_gradients(self, params) -> None:
        pass

    def clip_gradients(self, params, max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def sum_(self, tensor):
        return tensor

    def sum_figures(self, sums, device):
        return sums


def _update(case: str, model, parallel=None, dtype=torch.float32):
    settings = _settings(case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    learner = Learner(model, optimizer, settings, pad_token_id=0, seed=5, parallel=parallel)
    passes = []
    real = learner.forward.logprobs
    learner.forward.logprobs = lambda micro, **kw: passes.append(len(micro)) or real(micro, **kw)
    batch = collate(_scored_episodes(64, LENGTHS, seed=4), 0, advantages=ADVANTAGES)
    metrics = learner.update(batch)
    return metrics, passes


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("case", list(CASES))
def test_idle_passes_train_nothing_and_change_no_figure(case):
    want_model, padded_model = _model().double(), _model().double()
    want, plain = _update(case, want_model)
    ranks = PaddedRanks()
    got, passes = _update(case, padded_model, ranks)
    assert ranks.asked > 0 and len(passes) == len(plain) + 2 * ranks.asked  # the idle ones ran
    torch.testing.assert_close(_weights(padded_model), _weights(want_model), atol=1e-12, rtol=1e-12)
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "clip_frac"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-10, abs=1e-12), key


def test_a_critic_over_sharded_ranks_is_refused():
    model = _model()
    settings = _settings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="critic over sharded learner ranks"):
        Learner(model, optimizer, settings, pad_token_id=0, critic=torch.nn.Linear(2, 1),
                critic_optimizer=torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), parallel=PaddedRanks())


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from ctxrl.distributed.sharded import ShardedRanks, full_state_layers, shard_model

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for case in CASES:
            model = shard_model(_model())
            metrics, passes = _update(case, model, ShardedRanks())
            full = {k: v for piece in full_state_layers(model) for k, v in piece.items()}
            results[case] = (metrics, len(passes), full)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_learner")
    mp.start_processes(_rank, args=(2, f"file://{tmp / 'rendezvous'}", str(tmp / "result")), nprocs=2, join=True,
                       start_method="spawn")
    return [torch.load(tmp / f"result.{r}") for r in range(2)]


@pytest.mark.slow  # (two gloo processes importing torch and transformers: 13-54 s for the group)
@pytest.mark.parametrize("case", list(CASES))
def test_two_sharded_ranks_take_the_single_process_update(two_ranks, case):
    model = _model()
    want, _ = _update(case, model)
    state = model.state_dict()
    assert not torch.equal(state["model.norm.weight"], _model().state_dict()["model.norm.weight"])
    counts = []
    for metrics, passes, full in (r[case] for r in two_ranks):
        for name, tensor in state.items():
            torch.testing.assert_close(full[name], tensor, atol=2e-6, rtol=1e-5, msg=name)
        assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        counts.append(passes)
    assert counts[0] == counts[1]  # every forward of a sharded model is collective: both ranks ran as many
