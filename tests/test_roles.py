"""Several agents in one episode (issue 37, docs/multi-agent.md): the match loop, per-seat recording, the
one-role case, reward modes between seats, and who plays a role."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from ctxrl.algo.roles import seat_rewards
from ctxrl.engine.base import Completion
from ctxrl.engine.hf import HFEngine
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.base import EnvError
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.kuhn_poker import OPPONENTS, KuhnPokerEnv, payoff
from ctxrl.envs.propose_solve import ProposeSolveEnv
from ctxrl.envs.registry import register
from ctxrl.envs.roles import ONE_ROLE, OneSeat, roles_of, seat_role
from ctxrl.rollout.agent import run_episode, run_episodes
from ctxrl.rollout.managers.base import ContextPolicy
from ctxrl.rollout.match import OTHER_SEAT, SeatPolicy, play_match, run_matches
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.tasks.space import ContextParam, ContextSpace
from ctxrl.train.collect import trainable
from ctxrl.types import Message, TableStep, Task

BIG = RolloutLimits(max_turns=6, max_new_tokens=256, max_total_tokens=4096)
MALFORMED = "<tool_call>\n{not json}\n</tool_call>"
FIELDS = ("input_ids", "loss_mask", "behavior_logprobs", "turn_index", "turns", "messages", "reward", "success",
          "truncation", "segments", "group_id", "policy_version")


class Logged:
    """An engine replaying texts (in the order asked), each token with its own log-prob, remembering each call."""

    policy_version = 3

    def __init__(self, texts: list[str], renderer) -> None:
        self.texts, self.renderer, self.calls = list(texts), renderer, []

    async def generate(self, prompt_ids, params) -> Completion:
        ids = self.renderer.assistant_ids(self.texts.pop(0))
        logprobs = [-(len(self.calls) + 1) - i / 100 for i in range(len(ids))]
        self.calls.append((list(prompt_ids), ids, logprobs))
        return Completion(ids, logprobs, "stop")


def kuhn_task(cards: list[int], line: list[str]) -> Task:
    return Task(id=f"k-{cards}-{line}", prompt="p", answer="", context={"deck": 3}, data={"cards": cards, "line": line})


def same(a, b) -> None:
    for f in FIELDS:
        assert getattr(a, f) == getattr(b, f), f


def test_a_table_of_one_seat_records_what_the_agent_loop_records(model, renderer):
    """The single-agent protocol is the one-role case: sampled turns (cut off, here) and a scripted episode with a
    malformed call, a tool call and an answer, under the full and the window context manager."""
    engine = HFEngine(model, pad_token_id=renderer.tokenizer.pad_token_id)
    limits = RolloutLimits(max_turns=3, max_new_tokens=12, max_total_tokens=400, temperature=1.0)
    tasks = CalculatorEnv.sample_tasks("train", 3, seed=5)
    plain = asyncio.run(run_episodes(CalculatorEnv, tasks, engine, renderer, limits, group_size=2, seed=7))
    table = asyncio.run(run_matches(lambda: OneSeat(CalculatorEnv()), tasks,
                                    {ONE_ROLE: SeatPolicy("shared", engine=engine)}, renderer, limits,
                                    group_size=2, seed=7, roles=(ONE_ROLE,)))
    assert len(table) == len(plain) == 6 and {e.truncation for e in plain} == {"max_new_tokens"}
    for a, b in zip(plain, table):
        same(a, b)
        assert (b.role, b.info["seat"], b.info["policy"]) == (ONE_ROLE, ONE_ROLE, "shared") and a.role == ""
    window = RolloutLimits(max_turns=6, max_new_tokens=32, max_total_tokens=4096,
                           context=ContextPolicy(manager="window", max_context_tokens=280))
    cut = []
    for limits in (BIG, window):
        for task in tasks:
            texts = [MALFORMED, *CalculatorEnv.solve(task)]
            a = asyncio.run(run_episode(CalculatorEnv(), task, ScriptedEngine(texts, renderer), renderer, limits,
                                        seed=3))
            [b] = asyncio.run(play_match(OneSeat(CalculatorEnv()), task,
                                         {ONE_ROLE: SeatPolicy("shared", engine=ScriptedEngine(texts, renderer))},
                                         renderer, limits, seed=3))
            same(a, b)
            assert a.success and a.tool_calls == 2 and len(a.turns) == 3  # (the malformed call counts)
            cut.append(bool(b.segments))
    assert cut[:3] == [False] * 3 and any(cut[3:])  # the window manager cut a context, in both loops alike


def test_each_seat_records_its_own_sequence_and_only_what_it_saw(renderer):
    task = kuhn_task([3, 1], ["check", "bet", "call"])
    engine = Logged(["check", "bet", "call"], renderer)
    seating = {role: SeatPolicy("shared", engine=engine) for role in KuhnPokerEnv.roles}
    p0, p1 = asyncio.run(play_match(KuhnPokerEnv(), task, seating, renderer, BIG, seed=11, group_id=4, match=2))
    assert [(e.role, e.info["seat"], e.info["match"], e.group_id, e.policy_version) for e in (p0, p1)] == [
        ("player_0", "player_0", 2, 4, 3), ("player_1", "player_1", 2, 4, 3)]
    for episode, calls in ((p0, [0, 2]), (p1, [1])):
        n = len(episode.input_ids)
        assert len(episode.loss_mask) == len(episode.behavior_logprobs) == len(episode.turn_index) == n
        sampled = [(i, lp, t) for i, m, lp, t in zip(episode.input_ids, episode.loss_mask, episode.behavior_logprobs,
                                                     episode.turn_index) if m]
        expected = [(i, lp, turn) for turn, c in enumerate(calls) for i, lp in zip(engine.calls[c][1],
                                                                                  engine.calls[c][2])]
        assert sampled == expected  # its own turns' ids and log-probs, nobody else's
        assert all(lp == 0.0 for lp, m in zip(episode.behavior_logprobs, episode.loss_mask) if not m)
        for c in calls:  # each turn was sampled from exactly the seat's sequence so far
            prompt = engine.calls[c][0]
            assert episode.input_ids[: len(prompt)] == prompt
    text0, text1 = renderer.decode(p0.input_ids), renderer.decode(p1.input_ids)
    assert "Your card: 3" in text0 and "Your card: 1" not in text0 and "player_1 bets" in text0
    assert "Your card: 1" in text1 and "Your card: 3" not in text1 and "player_0 checks" in text1
    assert "You are player_0" in text0 and "You are player_1" in text1  # the shared policy knows its role
    assert (p0.reward, p1.reward) == payoff([3, 1], ["check", "bet", "call"]) == (2.0, -2.0)
    assert [t.reward for t in p0.turns] == [0.0, 2.0] and [t.reward for t in p1.turns] == [-2.0]
    assert (p0.success, p1.success, p0.truncation, p1.truncation) == (True, False, None, None)


def test_scripted_and_frozen_seats_are_recorded_but_never_train(renderer, model):
    task = kuhn_task([1, 2], ["bet", "call"])
    frozen = HFEngine(model, pad_token_id=renderer.tokenizer.pad_token_id)
    seating = {"player_0": SeatPolicy("shared", engine=Logged(["bet"], renderer)),
               "player_1": SeatPolicy("scripted:always_bet", script=OPPONENTS["always_bet"], trains=False)}
    p0, p1 = asyncio.run(play_match(KuhnPokerEnv(), task, seating, renderer, BIG, seed=1))
    assert [t.text for t in p1.turns] == ["call"] and not any(p1.loss_mask) and p1.behavior_logprobs == [0.0] * len(
        p1.input_ids)  # written by a script: context, never a target
    assert (p0.reward, p1.reward) == (-2.0, 2.0) and p1.info == {**p1.info, "policy": "scripted:always_bet",
                                                                 "trains": False}
    assert trainable(p0) and not trainable(p1)
    seating["player_1"] = SeatPolicy("frozen:somewhere", engine=frozen, trains=False)
    seating["player_0"] = SeatPolicy("shared", engine=Logged(["bet"], renderer))
    short = RolloutLimits(max_turns=2, max_new_tokens=8, max_total_tokens=4096)
    p0, p1 = asyncio.run(play_match(KuhnPokerEnv(), task, seating, renderer, short, seed=1))
    assert any(p1.loss_mask) and p1.info["trains"] is False and not trainable(p1)  # sampled, but not ours to train
    assert p1.turns[0].finish_reason == "length"  # the random model's reply was cut off: in a match of two seats
    assert p1.truncation is None and (p0.reward, p1.reward) == (0.0, -2.0)  # the environment judged it: invalid


def test_a_failing_environment_errors_every_seat_and_limits_end_the_match(renderer):
    class Broken(KuhnPokerEnv):
        async def step(self, message):
            raise RuntimeError("boom")

    task = kuhn_task([2, 3], ["check", "check"])
    engine = Logged(["check"] * 4, renderer)
    seating = {role: SeatPolicy("shared", engine=engine) for role in KuhnPokerEnv.roles}
    episodes = asyncio.run(play_match(Broken(), task, seating, renderer, BIG))
    assert [(e.truncation, e.info["error_kind"]) for e in episodes] == [("error", "step")] * 2
    one_turn = RolloutLimits(max_turns=1, max_new_tokens=16, max_total_tokens=4096)
    engine = Logged(["check", "bet", "fold"], renderer)
    seating = {role: SeatPolicy("shared", engine=engine) for role in KuhnPokerEnv.roles}
    p0, p1 = asyncio.run(play_match(KuhnPokerEnv(), kuhn_task([2, 3], ["check", "bet", "fold"]), seating, renderer,
                                    one_turn))
    assert (p0.truncation, p1.truncation) == ("max_turns", OTHER_SEAT)  # player_0 was asked for a second turn
    failed = asyncio.run(run_matches(lambda: 1 / 0, [task], seating, renderer, BIG, roles=KuhnPokerEnv.roles))
    assert [(e.role, e.info["error_kind"]) for e in failed] == [("player_0", "constructor"),
                                                               ("player_1", "constructor")]


def test_seat_rewards_by_hand():
    rewards = {"a": 1.0, "b": -3.0}
    assert seat_rewards(rewards, ["a", "b", "c"], "env") == {"a": 1.0, "b": -3.0, "c": 0.0}
    assert seat_rewards(rewards, ["a", "b", "c"], "team") == pytest.approx({s: -2 / 3 for s in "abc"})
    zero = seat_rewards(rewards, ["a", "b", "c"], "zero_sum")
    assert zero == pytest.approx({"a": 5 / 3, "b": -7 / 3, "c": 2 / 3}) and sum(zero.values()) == pytest.approx(0)
    assert seat_rewards({"a": 2.0, "b": -2.0}, ["a", "b"], "zero_sum") == {"a": 2.0, "b": -2.0}  # zero-sum already
    with pytest.raises(ValueError, match="not seats"):
        seat_rewards({"z": 1.0}, ["a"], "env")
    with pytest.raises(ValueError, match="reward mode"):
        seat_rewards({}, ["a"], "both")


def test_team_rewards_reach_every_seat_of_a_match(renderer):
    task = kuhn_task([3, 1], ["bet", "fold"])
    engine = Logged(["bet", "fold"], renderer)
    seating = {role: SeatPolicy("shared", engine=engine) for role in KuhnPokerEnv.roles}
    team = asyncio.run(play_match(KuhnPokerEnv(), task, seating, renderer, BIG, reward_mode="team"))
    assert [e.reward for e in team] == [0.0, 0.0]  # a zero-sum hand pays a team nothing


def test_propose_solve_pays_the_proposer_for_problems_at_the_solvers_edge(renderer):
    task = ProposeSolveEnv.sample_tasks("train", 1, seed=0)[0]
    right, wrong = f"<answer>{task.answer}</answer>", "<answer>-1</answer>"
    texts = [f"<problem>{task.data['expression']}</problem>", right, wrong, right, wrong]
    engine = ScriptedEngine(texts, renderer)  # one policy plays every seat, in play order
    seating = {role: SeatPolicy("shared", engine=engine) for role in ProposeSolveEnv.roles}
    episodes = asyncio.run(play_match(ProposeSolveEnv(), task, seating, renderer, BIG))
    assert [e.info["seat"] for e in episodes] == ["proposer", "solver/0", "solver/1", "solver/2", "solver/3"]
    assert [e.role for e in episodes] == ["proposer"] + ["solver"] * 4
    assert [e.reward for e in episodes] == [1.0, 1.0, 0.0, 1.0, 0.0]  # 2 of 4 solved: 1 - 2|1/2 - 1/2|
    assert [e.success for e in episodes] == [True, True, False, True, False]
    assert "Solve: " + task.data["expression"] in renderer.decode(episodes[1].input_ids)
    assert task.data["expression"] not in renderer.decode(episodes[2].input_ids[:20])
    invalid = ScriptedEngine(["<problem>what is love</problem>"], renderer)
    seating = {role: SeatPolicy("shared", engine=invalid) for role in ProposeSolveEnv.roles}
    episodes = asyncio.run(play_match(ProposeSolveEnv(), task, seating, renderer, BIG))
    assert episodes[0].reward == -1.0 and all(not e.input_ids and e.reward == 0 for e in episodes[1:])
    assert not any(trainable(e) for e in episodes[1:])  # solvers that never played have nothing to train


def test_seats_and_roles_helpers():
    assert seat_role("solver/3") == "solver" and seat_role("player_0") == "player_0"
    assert roles_of(CalculatorEnv) == (ONE_ROLE,) and roles_of(KuhnPokerEnv) == ("player_0", "player_1")


@register("say_game_for_test")
class SayGame:
    """Two seats say one thing each; player_0 is paid the length of what player_1 said, mod 3, player_1 that of
    what player_0 said, mod 2 (any reply is a move, so a random model plays whole matches)."""

    name: ClassVar[str] = "say_game_for_test"
    roles: ClassVar[tuple[str, ...]] = ("player_0", "player_1")
    system_prompt: ClassVar[str] = "Say something."
    context_space: ClassVar[ContextSpace] = ContextSpace([ContextParam("n", "int", low=1, high=9, default=1)])

    def __init__(self) -> None:
        self.tools, self.said = [], []

    @classmethod
    def sample_tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        return [Task(id=f"say-{split}-{seed}-{i}", prompt=f"say {split} {seed} {i}", answer="", split=split,
                     context={"n": 1}) for i in range(n)]

    @classmethod
    def solve(cls, task: Task) -> list[str]:
        return ["hello", "hi"]

    @classmethod
    def gold_rewards(cls, task: Task) -> dict[str, float]:
        return {"player_0": 2.0, "player_1": 1.0}

    def reset(self, task: Task, *, seed: int | None = None) -> dict[str, list[Message]]:
        self.said = []
        return {seat: [Message("system", f"You are {seat}."), Message("user", "Speak.")] for seat in self.roles}

    def to_act(self) -> str:
        if len(self.said) >= len(self.roles):
            raise EnvError("the game is over")
        return self.roles[len(self.said)]

    def view(self, seat: str) -> dict:
        return {}

    async def step(self, message: Message) -> TableStep:
        self.said.append(message.content)
        if len(self.said) == 1:
            return TableStep(messages={"player_1": [Message("user", "player_0 spoke.")]})
        return TableStep(rewards={"player_0": float(len(self.said[1]) % 3), "player_1": float(len(self.said[0]) % 2)},
                         terminated=True)

    def close(self) -> None:
        pass
