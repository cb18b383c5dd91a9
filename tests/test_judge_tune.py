"""experiments/judge_tune.py: its examples (balanced pairs, labels the calculator's verifier agrees with, near misses
that really are wrong), the prompt it trains on (what ``Judge`` asks about a real episode, through the tiny model's
and SmolLM2's chat templates), the loss on completion tokens only (against a hand computation), the saved judge
loaded by ``reward.judge`` as a run loads it, and the errors that name the fix."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import torch

from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.tool_answer import parse_answer
from ctxrl.errors import ConfigError
from ctxrl.judge.judge import Judge
from ctxrl.judge.spec import JudgeSettings
from ctxrl.types import Episode, Message, Task

ROOT = Path(__file__).resolve().parents[1]
TINY = "tiny:pretrain_steps=0"
RUBRIC = str(ROOT / "examples/rubrics/answer_matches_reference.toml")
SCRIPT = ROOT / "experiments/judge_tune.py"


@pytest.fixture(scope="module")
def jt():
    """experiments/judge_tune.py as a module (registered first: its dataclass looks its module up)."""
    spec = importlib.util.spec_from_file_location("judge_tune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["judge_tune"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("judge_tune", None)


def local_judge(target: str, max_tokens: int = 4) -> Judge:
    """The judge a run with ``reward.judge.target=target`` and the script's reward settings builds."""
    return Judge.from_spec(JudgeSettings(target=target, rubric=RUBRIC, input="answer", reference=True,
                                         max_tokens=max_tokens, cache="off"))


def played(task: Task, final: str) -> Episode:
    """A calculator episode as a rollout records it: the system prompt, the task, a tool call and its result, then
    ``final``."""
    call = CalculatorEnv.solve(task)[0]
    return Episode(task=task, messages=[Message("system", CalculatorEnv.system_prompt), Message("user", task.prompt),
                                        Message("assistant", call), Message("tool", task.answer, name="calculator"),
                                        Message("assistant", final)])


# -- examples ---------------------------------------------------------------------------------------------------
def test_examples_are_balanced_pairs_and_the_verifier_agrees_with_every_label(jt):
    tasks = jt.draw_tasks(CalculatorEnv, "calculator", "train", 150, 0)
    examples = jt.make_examples(CalculatorEnv, tasks, 300, 0)
    assert len(examples) == 300 and sum(e.label for e in examples) == 150
    verifier = CalculatorEnv()
    for yes, no in zip(examples[::2], examples[1::2]):
        assert yes.task is no.task and yes.label and not no.label and yes.kind == "match"
        assert yes.answer == CalculatorEnv.solve(yes.task)[-1] == f"<answer>{yes.task.answer}</answer>"
        wrong = parse_answer(no.answer)
        assert no.answer == f"<answer>{wrong}</answer>"  # the gold message, only its answer changed
        assert not (wrong.lstrip("+-").replace(".", "").isdigit() and Decimal(wrong) == Decimal(yes.task.answer))
    for e in examples:
        assert verifier.check_answer(parse_answer(e.answer), e.task)[0] == e.label, e
    kinds = {e.kind for e in examples if not e.label}
    assert kinds == {"off_by_one", "digit", "sign", "other_task", "empty", "not_a_number"}  # no letters to change
    assert [e.label for e in jt.make_examples(CalculatorEnv, tasks, 5, 0)] == [True, False, True, False, True]
    assert jt.make_examples(CalculatorEnv, tasks, 20, 0) == examples[:20]  # seeded
    heldout = jt.draw_tasks(CalculatorEnv, "calculator", "train", 50, 1, avoid={t.prompt for t in tasks})
    assert not {t.prompt for t in heldout} & {t.prompt for t in tasks} and len({t.prompt for t in heldout}) == 50


def test_near_misses_are_wrong_by_construction(jt):
    import random

    rng = random.Random(0)
    for reference, kinds in [("10", {"off_by_one", "digit", "sign", "other_task", "empty", "not_a_number"}),
                             ("0", {"off_by_one", "digit", "other_task", "empty", "not_a_number"}),
                             ("-46", {"off_by_one", "digit", "sign", "other_task", "empty", "not_a_number"}),
                             ("Irris", {"other_task", "empty", "character"}),
                             ("698 179", {"digit", "other_task", "empty"})]:
        seen = set()
        for _ in range(300):
            answer, kind = jt.wrong_answer(reference, ["10", "0", "Irris", "698 179"], rng)
            seen.add(kind)
            assert jt.differs(answer, reference), (reference, answer, kind)
            assert not answer.startswith("0") or answer == "0" or reference == "0"  # never 010 for 10
        assert seen == kinds, reference
    assert jt.wrong_answer("7", [], rng)[1] != "other_task"  # no other task to take an answer from
    assert not jt.differs("42.0", "42") and not jt.differs("+42", "42") and not jt.differs(" paris", "Paris")
    assert jt.differs("-42", "42") and jt.differs("N", "42")


# -- what the judge is shown ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [TINY, "smollm2-135m-instruct"])
def test_the_training_prompt_is_what_the_judge_asks_about_a_played_episode(jt, tiny_path, model):
    judge = local_judge(model)
    words = jt.verdict_words(judge.rubric, RUBRIC)
    assert words == ("Yes", "No")
    tasks = CalculatorEnv.sample_tasks("train", 3, 0)
    renderer = judge.backend.renderer
    for example in jt.make_examples(CalculatorEnv, tasks, 6, 0):
        prompt, completion = jt.render(judge, example, words)
        messages, _ = judge.question(played(example.task, example.answer))  # a rollout's episode, tool turns and all
        assert prompt == renderer.prompt_ids(messages, None)  # the ids LocalBackend.complete prompts with
        text = renderer.decode(prompt)
        assert f"Reference answer (correct):\n{example.task.answer}\n" in text and f"\n{example.answer}\n" in text
        assert completion[-1] == renderer.end_ids[0] and completion[:-1] == renderer.encode(words[not example.label])
        assert judge.rubric.parse(renderer.decode(completion[:-1])) == {"correct": float(example.label)}
    if model != TINY:
        assert renderer.decode(completion[-1:]) == "<|im_end|>"  # SmolLM2's end of turn, not its GGUF's eos


def test_a_rubric_must_name_a_passing_and_a_failing_verdict(jt, tmp_path):
    from ctxrl.judge.rubric import DEFAULT, load_rubric

    with pytest.raises(ConfigError, match=r"has no \[labels\].*\[labels\] yes = 1, no = 0"):
        jt.verdict_words(DEFAULT, "")
    path = tmp_path / "pass.toml"
    path.write_text('scale = [0, 10]\n[[item]]\nname = "ok"\ndescription = "d"\n[labels]\npass = 10\nfail = 0\n'
                    "unsure = 5\n")
    assert jt.verdict_words(load_rubric(str(path)), str(path)) == ("Pass", "Fail")
    path.write_text('scale = [0, 10]\n[[item]]\nname = "ok"\ndescription = "d"\n[labels]\nmeh = 4\nfail = 0\n')
    with pytest.raises(ConfigError, match="one that passes"):
        jt.verdict_words(load_rubric(str(path)), str(path))


# -- training ---------------------------------------------------------------------------------------------------
def test_only_the_completion_tokens_are_trained(jt, model):
    """The mask is 1 exactly where the next token is a completion token; the loss is those tokens' mean negative
    log-likelihood, computed by hand one unpadded row at a time; what fills the padding changes nothing."""
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 200, (n,), generator=g).tolist(), torch.randint(3, 200, (k,), generator=g).tolist())
            for n, k in [(7, 2), (12, 3), (4, 1)]]
    input_ids, attention_mask, loss_mask = jt.pad(rows, pad_token_id=0)
    assert loss_mask.shape == (3, 14) and loss_mask.sum() == 6
    for row, (_, completion) in enumerate(rows):
        assert input_ids[row, 1:][loss_mask[row].bool()].tolist() == completion
    loss = jt.completion_loss(model, input_ids, attention_mask, loss_mask)
    terms = []
    for prompt, completion in rows:
        ids = torch.tensor([prompt + completion])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        terms += [logprobs[len(prompt) - 1 + i, token] for i, token in enumerate(completion)]
    assert loss.item() == pytest.approx(-torch.stack(terms).mean().item(), abs=1e-5)
    noisy = input_ids.clone()
    padding = attention_mask == 0
    noisy[padding] = torch.randint(3, 200, (int(padding.sum()),), generator=g)
    again = jt.completion_loss(model, noisy, attention_mask, loss_mask)
    assert again.item() == pytest.approx(loss.item(), abs=1e-6)


# -- the command ------------------------------------------------------------------------------------------------
def test_the_tuned_judge_saves_reloads_as_reward_judge_and_its_verdict_parses(jt, tiny_path, tmp_path):
    from ctxrl.models.loader import generation_end_ids, load_tokenizer

    save, out = tmp_path / "judge", tmp_path / "report.json"
    argv = ["--env", "calculator", "--rubric", RUBRIC, "--model", TINY, "--examples", "48", "--eval-examples", "8",
            "--steps", "24", "--batch-size", "8", "--lr", "3e-3", "--max-tokens", "4", "--device", "cpu",
            "--save", str(save), "--out", str(out)]
    report = jt.main(argv)
    losses = report["train"]["losses"]
    assert len(losses) == 24 and losses[-1] < losses[0] / 2
    assert report["before"]["examples"] == report["after"]["examples"] == 8
    assert report["after"]["no_verdict"] == 0.0  # it learned to answer with a verdict word
    assert json.loads(out.read_text()) == json.loads((save / jt.MARKER).read_text()) == json.loads(json.dumps(report))
    assert "reward.judge.input=answer reward.judge.reference=true" in report["use"]

    judge = local_judge(str(save))  # what a rollout worker builds from reward.judge.target=SAVE
    task = CalculatorEnv.sample_tasks("train", 1, 7)[0]
    graded = asyncio.run(judge.grade(played(task, f"<answer>{task.answer}</answer>")))
    assert graded["attempts"] == 1 and graded["score"] in (0.0, 1.0)  # parsed at the first, greedy, try
    assert generation_end_ids(str(save)) == generation_end_ids(tiny_path)
    assert load_tokenizer(str(save)).chat_template == load_tokenizer(tiny_path).chat_template

    again = jt.main([*argv[:-4], "--steps", "2", "--save", str(save)])  # a judge it saved is replaced
    assert len(again["train"]["losses"]) == 2 and not (tmp_path / "judge.partial").exists()


def test_bad_input_is_refused_before_any_model_loads_naming_the_fix(jt, tmp_path, capsys):
    from ctxrl.envs.base import EnvError

    small = ["--model", "/nonexistent/model", "--examples", "8", "--eval-examples", "4", "--batch-size", "4",
             "--save", ""]
    with pytest.raises(EnvError, match="unknown environment 'calculater'; did you mean 'calculator'"):
        jt.main(["--env", "calculater", *small])
    with pytest.raises(ConfigError, match=r"a tool call .*needs an environment that ends with a stated answer"):
        jt.main(["--env", "sokoban", *small])
    with pytest.raises(ConfigError, match=r"plays several roles \(player_0, player_1\)"):
        jt.main(["--env", "kuhn_poker", *small])
    with pytest.raises(ConfigError, match=r"has no \[labels\]: judge_tune trains a one-word verdict"):
        jt.main(["--rubric", "", *small])
    with pytest.raises(ConfigError, match=r"--rubric: reward.judge.rubric: cannot read"):
        jt.main(["--rubric", str(tmp_path / "missing.toml"), *small])
    with pytest.raises(ConfigError, match="no 'nope' tasks"):
        jt.main(["--eval-split", "nope", *small])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="is not a judge this script saved"):
        jt.main([*small[:-1], str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"

    class Silent:
        @classmethod
        def solve(cls, task):
            return ["I am done."]

    with pytest.raises(ConfigError, match=r"does not state the task's reference answer '5'"):
        jt.answer_frame(Silent, Task(id="t", prompt="2 + 3?", answer="5"))
    for argv, message in [(["--examples", "1"], "--examples 1 is too small"),
                          (["--examples", "8", "--batch-size", "32"], "smaller than --batch-size 32"),
                          (["--eval-examples", "1"], "--eval-examples 1 is too small")]:
        with pytest.raises(SystemExit):
            jt.main(argv)
        assert message in capsys.readouterr().err


def test_the_command_line_prints_one_line_errors_and_an_accurate_help():
    run = [sys.executable, str(SCRIPT)]
    failed = subprocess.run([*run, "--env", "calculater", "--save", ""], capture_output=True, text=True, cwd=ROOT)
    assert failed.returncode == 2 and failed.stderr.startswith("judge_tune: environment error: unknown environment")
    assert "Traceback" not in failed.stderr
    usage = " ".join(subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=ROOT).stdout.split())
    for option in ("--env", "--rubric", "--model", "--examples", "--eval-examples", "--eval-split", "--steps",
                   "--batch-size", "--lr", "--max-tokens", "--device", "--dtype", "--seed", "--save", "--out"):
        assert option in usage
    assert "reward.judge.max_tokens) (default: 64)" in usage and "(default: smollm2-135m-instruct)" in usage
