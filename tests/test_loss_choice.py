"""Choosing a policy loss (``algo.loss``) and an off-policy correction (``algo.offpolicy``) by name: each registered
one trains a learner update on the tiny model and logs its figures; a rejected sequence leaves the loss and its
denominators; unknown names and settings in the wrong table are config errors naming the right thing."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from ctxrl.algo.offpolicy import offpolicy_correction_names
from ctxrl.algo.policy_losses import declared, get_policy_loss, policy_loss_names
from ctxrl.config import ConfigError, load_config
from ctxrl.learner.batch import collate
from ctxrl.learner.learner import Learner
from ctxrl.run.build import learner_settings

LENGTHS, ADVANTAGES = [9, 5, 7, 4], [1.0, -0.5, 2.0, -1.0]


def update(model, scored_episodes, overrides: list[str], *, batch=None) -> tuple[dict, torch.nn.Module]:
    """One learner update of a copy of ``model`` under the config ``overrides`` make (float64, no clipping)."""
    config = load_config(None, ["train.mini_batches=1", "rollout.temperature=1.0", "train.max_grad_norm=1e9",
                                *overrides])
    if batch is None:
        batch = collate(scored_episodes(model.config.vocab_size, LENGTHS), 0, advantages=ADVANTAGES)
    m = copy.deepcopy(model).double()
    learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.1), learner_settings(config), pad_token_id=0)
    return learner.update(batch), m


@pytest.mark.parametrize("name", policy_loss_names())
def test_each_registered_loss_trains_an_update_chosen_by_name(name, model, scored_episodes):
    aggregations = declared(get_policy_loss(name)).aggregations
    metrics, trained = update(model, scored_episodes, [f"algo.loss={name}",
                                                       f"algo.agg={aggregations[0] if aggregations else 'token-mean'}"])
    figures = declared(get_policy_loss(name)).figures
    assert set(figures) <= set(metrics), name  # the loss's own figures reach the step's row
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", *figures))
    assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0
    moved = [p for p, q in zip(trained.parameters(), model.double().parameters()) if not torch.equal(p, q)]
    model.float()
    assert moved  # it trained


@pytest.mark.parametrize("name", offpolicy_correction_names())
def test_each_registered_correction_trains_an_update_and_logs_what_it_changed(name, model, scored_episodes):
    metrics, _ = update(model, scored_episodes, ["algo.old_logprobs=recompute", f"algo.offpolicy={name}"])
    model.float()
    assert {"offpolicy_ratio_mean", "offpolicy_weight_mean"} <= set(metrics), sorted(metrics)
    changed = {"offpolicy_clipped_frac", "offpolicy_masked_frac"} & set(metrics)
    assert changed, sorted(metrics)  # what it clipped or masked
    assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith("offpolicy_") or k == "loss")


def test_no_correction_by_default_and_token_tis_keeps_its_key(model, scored_episodes):
    """The default trains as before (no correction, no offpolicy figures); ``algo.tis_cap`` is still token TIS."""
    plain, _ = update(model, scored_episodes, [])
    capped, _ = update(model, scored_episodes, ["algo.old_logprobs=recompute", "algo.tis_cap=2.0"])
    model.float()
    assert not [k for k in plain if k.startswith("offpolicy_")] and "tis_weight" not in plain
    assert "tis_truncated" in capped and not [k for k in capped if k.startswith("offpolicy_")]


def test_a_rejected_sequence_leaves_the_loss_and_its_denominators(model, scored_episodes):
    """Seq-MIS rejects the one sequence whose behaviour log-probs are 1 nat below the learner's at every token (its
    ratio e^n > upper): the update equals the update on the other rows alone, the token-mean's denominator theirs."""
    batch = collate(scored_episodes(model.config.vocab_size, LENGTHS), 0, advantages=ADVANTAGES)
    probe = Learner(copy.deepcopy(model).double(), torch.optim.SGD(model.parameters(), lr=0.0),
                    learner_settings(load_config(None, ["algo.old_logprobs=recompute", "rollout.temperature=1.0"])),
                    pad_token_id=0)
    learner_old = probe.recompute_old_logprobs(batch)[0].recomputed.float()
    behaviour = learner_old.clone()
    behaviour[2] = (learner_old[2] - 1.0) * batch.loss_mask[2]  # row 2 leaves; the others have ratio 1
    batch = dataclasses.replace(batch, old_logprobs=behaviour)
    corrected, trained = update(model, scored_episodes, ["algo.old_logprobs=recompute", "algo.offpolicy=sequence_mis",
                                                         "algo.sequence_mis.upper=2.0"], batch=batch)
    kept, alone = update(model, scored_episodes, ["algo.old_logprobs=recompute"], batch=batch.select([0, 1, 3]))
    model.float()
    assert corrected["offpolicy_seq_masked_frac"] == pytest.approx(0.25)
    assert corrected["loss"] == pytest.approx(kept["loss"], rel=1e-9, abs=1e-12)
    for p, q in zip(trained.parameters(), alone.parameters()):
        assert torch.allclose(p, q, atol=1e-10)


@pytest.mark.parametrize("overrides, message", [
    (["algo.loss=ppo"], r"algo.loss must be one of ppo_clip, gspo, cispo, gmpo, sapo, clip_cov, kl_cov, dppo_tv, "
                        r"dppo_kl"),
    (["algo.old_logprobs=recompute", "algo.offpolicy=icepops"],
     r"algo.offpolicy must be one of token_tis, sequence_tis, sequence_mis, geometric_mis, icepop, m2po .*did you "
     r"mean 'icepop'"),
    (["algo.offpolicy=icepop"], r"algo.offpolicy=icepop corrects recomputed old log-probs.*old_logprobs=recompute"),
    (["algo.old_logprobs=recompute", "algo.offpolicy=icepop", "algo.tis_cap=2"], r"set algo.tis_cap=0"),
])
def test_an_unknown_or_unusable_name_is_a_config_error_listing_the_choices(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["algo.gspo.dual_clip=3"], r"algo.gspo.dual_clip is not a setting of \[algo.gspo\]; dual_clip is a setting of "
                                r"\[algo.ppo_clip\]"),
    (["algo.loss=sapo", "algo.tau_pos=2"], r"unknown config key algo.tau_pos; tau_pos is a setting of \[algo.sapo\]"),
    (["algo.icepop.cap=2"], r"cap is a setting of \[algo.token_tis\] and \[algo.sequence_tis\]"),
    (["algo.loss=cispo", "algo.clip_high=0.3"], r"algo.loss=cispo does not read: set \[algo.cispo\].clip_high"),
    (["algo.loss=gspo", "algo.ppo_clip.dual_clip=3"], r"\[algo.ppo_clip\] sets the settings of policy loss "
                                                      r"'ppo_clip', but algo.loss=gspo"),
    (["algo.old_logprobs=recompute", "algo.offpolicy=icepop", "algo.sequence_mis.upper=3"],
     r"\[algo.sequence_mis\] sets the settings of off-policy correction 'sequence_mis', but algo.offpolicy=icepop"),
    (["algo.loss=gmpo"], r"algo.loss=gmpo is defined for algo.agg=seq-mean-token-mean"),
])
def test_a_setting_in_the_wrong_place_is_an_error_naming_the_right_one(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_old_dual_clip_key_loads_into_its_table_and_names_it():
    with pytest.warns(DeprecationWarning, match="algo.dual_clip was renamed algo.ppo_clip.dual_clip"):
        config = load_config(None, ["algo.dual_clip=3"])
    assert config.settings_of("algo", "ppo_clip").dual_clip == 3.0
    assert learner_settings(config).loss_keywords == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}
    with pytest.raises(ConfigError, match=r"dual_clip must be > 1 \(or 0 = off\)"):
        load_config(None, ["algo.ppo_clip.dual_clip=0.5"])
