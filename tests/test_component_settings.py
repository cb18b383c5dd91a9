"""A registered component's own settings (``ctxrl.settings``): the worked example of docs/algorithms.md ("Settings
of its own") run as written, its table read from a file and from the command line, the errors, the round trip
through a run's saved config, and ``--resume`` refusing a changed value."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from ctxrl.config import ConfigError, from_dict, load_config, to_toml
from ctxrl.settings import RESUMABLE

DOC = Path(__file__).resolve().parents[1] / "docs" / "algorithms.md"


def doc_block(first_line: str, language: str) -> str:
    """The fenced ``language`` block of docs/algorithms.md whose first line is ``first_line``."""
    for block in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"docs/algorithms.md has no {language} block starting {first_line!r}")


def importable_doc_block(tmp_path_factory, module: str):
    """The doc's ``# MODULE.py`` block written to a folder on ``sys.path`` (yields the folder, then takes it off)."""
    folder = tmp_path_factory.mktemp(module)
    (folder / f"{module}.py").write_text(doc_block(f"# {module}.py", "python"))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The doc's capped_grpo.py, importable as a plugin (run.plugins = "capped_grpo")."""
    yield from importable_doc_block(tmp_path_factory, "capped_grpo")


def test_the_docs_example_reads_its_table_and_caps_the_advantages(plugin, tmp_path):
    from ctxrl.algo.estimators import get_estimator

    path = tmp_path / "capped.toml"
    path.write_text(doc_block("[run]", "toml"))
    config = load_config(path)
    assert config.components == {"algo.capped_grpo": {"limit": 0.5}}
    options = config.settings_of("algo", "capped_grpo")
    assert options.limit == 0.5 and type(options).__name__ == "CappedSettings"
    estimator = get_estimator("capped_grpo")(options=options)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    # GRPO: (1 - 0.5) / std([1, 0]) = 0.5 / 0.7071 = 0.7071 -> capped at 0.5; a group of equal rewards gets 0
    assert estimator.advantages(rewards, torch.zeros(4), groups).tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    uncapped = get_estimator("capped_grpo")()  # no table: the settings' defaults (limit 1.0)
    assert uncapped.options.limit == 1.0
    assert uncapped.advantages(rewards, torch.zeros(4), groups)[0].item() == pytest.approx(0.7071, abs=1e-4)


def test_the_command_line_sets_a_component_key_and_a_saved_config_keeps_it(plugin):
    config = load_config(None, ["run.plugins=capped_grpo", "algo.advantage=capped_grpo", "algo.capped_grpo.limit=2"])
    assert config.components["algo.capped_grpo"] == {"limit": 2.0}  # an int where a float is expected
    text = to_toml(config)
    assert "[algo.capped_grpo]\nlimit = 2.0\n" in text
    again = from_dict(tomllib.loads(text))  # as a run's config.toml is read on resume
    assert again.components == config.components and again == config


def test_resume_refuses_a_changed_component_setting(plugin):
    from ctxrl.train.checkpoint import config_differences

    base = ["run.plugins=capped_grpo", "algo.advantage=capped_grpo"]
    saved = load_config(None, [*base, "algo.capped_grpo.limit=0.5"])
    assert config_differences(saved, load_config(None, [*base, "algo.capped_grpo.limit=0.5"])) == []
    assert config_differences(saved, load_config(None, [*base, "algo.capped_grpo.limit=0.7"])) == [
        "algo.capped_grpo.limit: 0.5 -> 0.7"]
    assert config_differences(saved, load_config(None, base)) == ["algo.capped_grpo.limit: 0.5 -> None"]


@pytest.mark.parametrize("override, message", [
    ("algo.capped_grpo.limt=0.5", r"unknown config key algo.capped_grpo.limt; did you mean 'algo.capped_grpo.limit'"),
    ("algo.capped_grpo.limit=\"big\"", r"algo.capped_grpo.limit must be a float, got 'big'"),
    ("algo.capped_grpo.limit=-1", r"\[algo.capped_grpo\]: limit must be > 0, got -1.0"),
    ("algo.grpo.limit=0.5", r"\[algo.grpo\]: algo component 'grpo' has no settings of its own"),
    ("algo.nope.limit=0.5", r"\[algo.nope\]: unknown advantage estimator 'nope'"),
])
def test_a_bad_component_table_is_a_config_error_naming_it(plugin, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["run.plugins=capped_grpo", override])


def test_a_table_in_a_section_without_components_is_still_an_unknown_key():
    with pytest.raises(ConfigError, match="unknown config key train.nope"):
        load_config(None, ["train.nope.x=1"])


def test_a_component_without_a_table_reads_its_defaults_and_one_without_settings_none(plugin):
    config = load_config(None, ["run.plugins=capped_grpo"])
    assert config.components == {} and config.settings_of("algo", "capped_grpo").limit == 1.0
    assert config.settings_of("algo", "grpo") is None and config.settings_of("context", "window") is None
    assert config.settings_of("context", "summarize").max_summaries == 2  # (a built-in's own table, issue 50)


def test_a_context_manager_gets_its_table_through_the_rollout_spec_as_plain_data():
    from dataclasses import dataclass

    from ctxrl.rollout.managers import register_manager
    from ctxrl.rollout.managers.full import Full
    from ctxrl.rollout.spec import RolloutSpec

    @dataclass(frozen=True)
    class NoteSettings:
        note: str = "none"
        """A word the manager keeps (for this test)."""

    @register_manager
    class Noted(Full):
        name = "noted_for_test"
        Settings = NoteSettings

    config = load_config(None, ["context.manager=noted_for_test", "context.noted_for_test.note=kept"])
    spec = RolloutSpec.from_config(config)
    assert spec.train.context.options == {"note": "kept"} and spec.eval.context.options == {"note": "kept"}
    again = RolloutSpec.from_dict(spec.to_dict())  # as a worker in another process or a Ray actor reads it
    manager = again.train.context.make()
    assert isinstance(manager, Noted) and manager.options == NoteSettings("kept")
    default = RolloutSpec.from_config(load_config(None, ["context.manager=noted_for_test"])).train.context.make()
    assert default.options == NoteSettings()
    assert RolloutSpec.from_config(load_config(None, [])).train.context.make().options is None  # full: none
    with pytest.raises(ConfigError, match=r"unknown config key context.noted_for_test.nte"):
        load_config(None, ["context.manager=noted_for_test", "context.noted_for_test.nte=x"])


def test_an_environment_gets_its_table_as_options_on_its_configured_class():
    from dataclasses import dataclass

    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.envs.registry import register
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class

    @dataclass(frozen=True)
    class Greeting:
        word: str = "hello"
        """How the environment greets (for this test)."""

    @register("calculator_settings_for_test")
    class Greeter(CalculatorEnv):
        Settings = Greeting

    config = load_config(None, ["env.name=calculator_settings_for_test", "env.calculator_settings_for_test.word=hi"])
    spec = RolloutSpec.from_dict(RolloutSpec.from_config(config).to_dict())  # as another process reads it
    cls = spec_env_class(spec)
    assert issubclass(cls, Greeter) and cls.options == Greeting("hi") and cls().options.word == "hi"
    assert spec_env_class(spec) is cls  # the same table, the same class
    plain = spec_env_class(RolloutSpec.from_config(load_config(None, ["env.name=calculator_settings_for_test"])))
    assert plain.options == Greeting() and plain is not cls
    from ctxrl.envs.tool_answer import Settings as ToolAnswerSettings

    # calculator: the settings every tool-answer environment has (its context ranges), at their defaults
    assert spec_env_class(RolloutSpec.from_config(load_config(None, []))).options == ToolAnswerSettings()
    with pytest.raises(ConfigError, match=r"unknown config key env.calculator_settings_for_test.wrd"):
        load_config(None, ["env.name=calculator_settings_for_test", "env.calculator_settings_for_test.wrd=x"])
    with pytest.raises(ConfigError, match=r"\[env.no_such_env\]: unknown environment 'no_such_env'"):
        load_config(None, ["env.no_such_env.word=x"])


def test_resume_compares_a_component_table_with_its_defaults_filled_in(plugin):
    """A table written out at its defaults (an older run's config.toml writes every field) and no table at all are
    the same settings: resuming either with the other finds no difference."""
    from ctxrl.train.checkpoint import config_differences

    base = ["run.plugins=capped_grpo", "algo.advantage=capped_grpo"]
    written = load_config(None, [*base, "algo.capped_grpo.limit=1.0"])
    assert written.components == {"algo.capped_grpo": {"limit": 1.0}}
    assert config_differences(written, load_config(None, base)) == []
    assert config_differences(load_config(None, base), written) == []


@dataclasses.dataclass(frozen=True)
class NotesSettings:
    """The settings of a component of a fixed section (this test's): one that may change on resume, one not."""

    verbosity: int = dataclasses.field(default=1, metadata=RESUMABLE)
    """How much it logs (may change on --resume)."""
    level: int = 0
    """What it computes with."""


def test_a_fixed_table_and_its_resumable_field(monkeypatch):
    """A section whose components are a fixed few (``Fixed``: a name and its settings class): its table loads,
    the configuration reference lists it, and its RESUMABLE field may change on resume while the other may not."""
    from ctxrl.config import describe_components, resumable_keys, resumable_summary
    from ctxrl.run.components import COMPONENT_REGISTRIES, Fixed
    from ctxrl.train.checkpoint import config_differences

    monkeypatch.setitem(COMPONENT_REGISTRIES, "report", Fixed({"notes": f"{__name__}:NotesSettings"}))
    saved = load_config(None, ["report.notes.level=2"])
    assert saved.components == {"report.notes": {"verbosity": 1, "level": 2}}
    assert saved.settings_of("report", "notes") == NotesSettings(level=2)
    assert config_differences(saved, load_config(None, ["report.notes.level=2", "report.notes.verbosity=3"])) == []
    assert config_differences(saved, load_config(None, [])) == ["report.notes.level: 2 -> None"]
    assert "report.notes.verbosity" in resumable_keys() and "report.notes.level" not in resumable_keys()
    assert "report.notes.verbosity" in resumable_summary().split(", ")
    assert [row[0] for row in describe_components() if row[0].startswith("report.")] == [
        "report.notes.verbosity", "report.notes.level"]
    with pytest.raises(ConfigError, match=r"\[report.nope\]: no component 'nope' has a table here; the tables are "
                                          "notes"):
        load_config(None, ["report.nope.level=1"])


def test_a_key_renamed_into_a_component_table_loads_warns_once_and_resumes(plugin, monkeypatch):
    """An old key moved into a component's table (``Renamed``): read there with one warning, dropped without one at
    its old default (no table opened), refused when both are set, and resumed against the new layout as equal."""
    import warnings

    from ctxrl import config as config_module
    from ctxrl.config import Renamed
    from ctxrl.train.checkpoint import config_differences

    monkeypatch.setattr(config_module, "RENAMED", (*config_module.RENAMED,
                                                   Renamed("algo.cap", "algo.capped_grpo.limit", default=1.0)))
    base = ["run.plugins=capped_grpo", "algo.advantage=capped_grpo"]
    with pytest.warns(DeprecationWarning, match=r"config key algo.cap was renamed algo.capped_grpo.limit; reading it "
                                                r"as algo.capped_grpo.limit = 0.5") as heard:
        old = load_config(None, [*base, "algo.cap=0.5"])
    assert len(heard) == 1 and old.components == {"algo.capped_grpo": {"limit": 0.5}}
    assert config_differences(old, load_config(None, [*base, "algo.capped_grpo.limit=0.5"])) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (at its old default: no word, and no table)
        assert load_config(None, [*base, "algo.cap=1.0"]).components == {}
    with pytest.raises(ConfigError, match="algo.cap was renamed algo.capped_grpo.limit; the config sets both, keep "
                                          "only algo.capped_grpo.limit"):
        load_config(None, [*base, "algo.cap=0.5", "algo.capped_grpo.limit=0.7"])


# -- a policy loss of its own: docs/algorithms.md, "Writing a loss" ------------------------------------------------
@pytest.fixture(scope="module")
def loss_plugin(tmp_path_factory):
    """The doc's capped_pg.py, importable as a plugin (run.plugins = "capped_pg")."""
    yield from importable_doc_block(tmp_path_factory, "capped_pg")
    from ctxrl.algo.policy_losses import POLICY_LOSSES

    POLICY_LOSSES._entries.pop("capped_pg", None)  # (the registry lists the built-ins alone again: test_policy_losses)
    sys.modules.pop("capped_pg", None)


def test_the_docs_loss_trains_an_rl_step_of_the_real_trainer(loss_plugin, tmp_path, monkeypatch):
    """The doc's file and table, as a user runs them: the registered name chosen by the config, its table read, its
    figure in the step's row; a misspelt name lists it among the choices."""

    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step
    from ctxrl.train import collect

    path = tmp_path / "capped_pg.toml"
    path.write_text(doc_block("# capped_pg.toml", "toml"))
    real = collect.shape_rewards

    def alternate(episodes, rc, **kw):  # (the untrained tiny model never succeeds: some signal to train on)
        for i, e in enumerate(episodes):
            e.reward = float(i % 2)
            e.success = bool(e.reward)
            if e.turns:
                e.turns[-1].reward = e.reward
        return real(episodes, rc, **kw)

    monkeypatch.setattr(collect, "shape_rewards", alternate)
    config = load_config(path, ["model.name=tiny:pretrain_steps=0", "sft.enabled=false", "rollout.tasks_per_step=2",
                                "rollout.group_size=2", "rollout.max_new_tokens=8", "run.progress=false",
                                "run.samples_per_step=0"])
    assert config.settings_of("algo", "capped_pg").cap == 1.5
    run = build(config, tmp_path / "run")
    learner = start_learning(run)
    assert learner.settings.loss_keywords == {"cap": 1.5}
    row = rl_step(run, 0)
    assert row["capped_frac"] == 0.0 and row["approx_kl"] >= 0.0  # (the first epoch is on-policy: r = 1)
    assert row["advantage_abs_mean"] > 0 and row["skipped"] == 0.0 and row["grad_norm"] > 0
    assert "clip_frac_low" not in row  # (PPO's figures are ppo_clip's: this loss declares its own)
    with pytest.raises(ConfigError, match="algo.loss must be one of .*capped_pg"):
        load_config(None, ["run.plugins=capped_pg", "algo.loss=capped_gp"])
    with pytest.raises(ConfigError, match=r"\[algo.capped_pg\]: cap must be > 0"):
        load_config(None, ["run.plugins=capped_pg", "algo.loss=capped_pg", "algo.capped_pg.cap=0"])


def test_the_docs_loss_gradient_is_its_formula(loss_plugin, model, scored_episodes):
    """A learner update with the doc's loss: its gradient is -sum_t sg(min(r, cap)) A grad logp / tokens, here
    on-policy (r = 1), so one SGD step of lr 1 moves the weights by exactly that gradient."""
    import copy

    from ctxrl.learner.batch import collate
    from ctxrl.learner.learner import Learner
    from ctxrl.learner.logprobs import token_logprobs
    from ctxrl.run.build import learner_settings

    config = load_config(None, ["run.plugins=capped_pg", "algo.loss=capped_pg", "train.mini_batches=1",
                                "rollout.temperature=1.0", "train.max_grad_norm=1e9"])  # (no clipping)
    batch = collate(scored_episodes(model.config.vocab_size, [9, 5, 7]), 0, advantages=[1.0, -0.5, 2.0])
    m = copy.deepcopy(model).double()
    lp = token_logprobs(m, batch.input_ids, batch.attention_mask, mask=batch.loss_mask, chunk=0)
    batch = dataclasses.replace(batch, old_logprobs=(lp.detach() * batch.loss_mask))
    (-(batch.advantages * lp * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    expected = [p.detach() - p.grad for p in m.parameters()]
    trained = copy.deepcopy(model).double()
    learner = Learner(trained, torch.optim.SGD(trained.parameters(), lr=1.0), learner_settings(config),
                      pad_token_id=0)
    metrics = learner.update(batch)
    assert metrics["capped_frac"] == 0.0 and metrics["approx_kl"] == pytest.approx(0.0, abs=1e-20)
    for got, want in zip(trained.parameters(), expected):
        assert torch.allclose(got, want, atol=1e-12)
