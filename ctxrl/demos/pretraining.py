"""The tiny model's text: the built-in environments' transcripts and whole chat episodes of their demonstrations.

Its tokenizer learns from ``tokenizer_texts``; its pre-training (``ctxrl.train.tiny``) runs on
``pretraining_batches``: plain-text transcripts (each environment's ``corpus`` hook, or its solved tasks as text)
and whole chat episodes played through the real agent loop (``ctxrl.demos.play``), fresh tasks everywhere.
"""

from __future__ import annotations

from ctxrl.chat.template import CHATML_TOOLS_TEMPLATE
from ctxrl.models.tiny import PRETRAIN_ENVS, TinySpec


def tokenizer_corpus(seed: int = 0, n: int = 2000, envs: tuple[str, ...] = PRETRAIN_ENVS) -> list[str]:
    """Text the tokenizer learns from (and the model pre-trains on): built-in environments' transcripts."""
    from ctxrl.envs.hooks import hook
    from ctxrl.envs.registry import get_env_class

    texts: list[str] = []
    for name in envs:
        env_cls = get_env_class(name)
        corpus = hook(env_cls, "corpus")
        if corpus is not None:
            texts.extend(corpus(n, seed))
    return texts


def number_texts() -> list[str]:
    """Every number 0-999 (and zero-padded 000-099, 00-09) once, so each becomes a BPE token."""
    return [" ".join(str(i) for i in range(1000)), " ".join(f"{i:03d}" for i in range(100)),
            " ".join(f"{i:02d}" for i in range(10))]


def tokenizer_texts(spec: TinySpec) -> list[str]:
    """What the tokenizer learns from: the environments' text, the chat template's and every number below 1000."""
    from ctxrl.chat.toolcalls import format_tool_call

    corpus = tokenizer_corpus(spec.seed, envs=spec.env_names())
    if spec.env_names() != PRETRAIN_ENVS:  # environments without a plain corpus: their chat text
        corpus += _solved_texts(spec.env_names(), 500, spec.seed)
    # The template's own text, so that its fixed phrases become few tokens; numbers 0-999 (as
    # whole tokens with the Llama pre-tokenizer: they are frequent enough to be merged).
    texts = corpus + [CHATML_TOOLS_TEMPLATE, format_tool_call("calculator", {"expression": "1 + 2"})] * 50
    return texts + number_texts() * 5


def pretraining_sequences(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of the multi-line corpus texts (whole solved-task transcripts), each ending in pad."""
    return [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.pad_token_id] for t in texts if "\n" in t]


def _solved_texts(envs: tuple[str, ...], n: int, seed: int) -> list[str]:
    """Prompts, solutions and tool observations of solved tasks, as text (for the tokenizer)."""
    from ctxrl.envs.base import pretraining_env
    from ctxrl.envs.check import play_solution
    from ctxrl.envs.hooks import hook
    from ctxrl.envs.registry import get_env_class

    texts = []
    for name in envs:
        env_cls = pretraining_env(get_env_class(name), seed)
        if hook(env_cls, "corpus") is not None:
            continue
        for task in env_cls.sample_tasks("train", n, seed):
            messages, _ = play_solution(env_cls, task, seed)
            texts.append("\n".join(m.content for m in messages))
    return texts


def chat_sequences(tokenizer, n: int, seed: int, envs: tuple[str, ...] = PRETRAIN_ENVS) -> list[list[int]]:
    """``n`` solved train tasks per environment, as whole chat episodes (system block and tools included).

    The scripted solutions are played through the real agent loop (as SFT demos are), so the
    ids are exactly what a rollout holds: the environment's system prompt and tool list, the
    task, the tool call, the tool response and the answer.
    """
    import asyncio

    from ctxrl.chat.render import ChatRenderer
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.registry import get_env_class

    renderer = ChatRenderer(tokenizer, template_name="tiny")
    sequences: list[list[int]] = []
    per_env = n if len(envs) == 1 else -(-n // len(envs))
    for name in envs:
        env_cls = get_env_class(name)
        if getattr(env_cls, "solve", None) is None:
            continue
        # other_worlds: a fresh invented world every few episodes where the env has one
        # (search_qa), so copying from observations is learnt and facts are not.
        for episode in asyncio.run(build_demos(env_cls, renderer, per_env, seed=seed, other_worlds=True)):
            sequences.append(list(episode.input_ids) + [tokenizer.pad_token_id])
    return sequences


def pretraining_batches(tokenizer, spec: TinySpec) -> list[list[list[int]]]:
    """``pretrain_steps`` batches of fresh train tasks (token-id sequences, each ending in pad).

    Even batches hold ``pretrain_batch_size`` plain-text transcripts (short, so copying is learnt
    cheaply); odd batches ``pretrain_chat_batch_size`` whole chat episodes in the rollout format,
    system block and tool list included: the model must learn to find the task's numbers behind
    a hundred tokens of system prompt. (Chat batches without the system block transferred worse:
    held-out success after the demo's RL 0.30 against 0.51 with it, one seed each.) Each batch
    holds one format only: a 170-token chat episode in a batch of 50-token plain ones would pad
    the whole batch. Fresh tasks everywhere: a small fixed corpus is memorised, not copied.
    """
    plain_size = spec.pretrain_batch_size
    chat_size = spec.pretrain_chat_batch_size or spec.pretrain_batch_size
    n_chat_batches = spec.pretrain_steps // 2
    n_plain_batches = spec.pretrain_steps - n_chat_batches
    plain = pretraining_sequences(tokenizer, tokenizer_corpus(spec.seed + 1, n_plain_batches * plain_size,
                                                              envs=spec.env_names()))
    chat = chat_sequences(tokenizer, n_chat_batches * chat_size, spec.seed + 2, spec.env_names()) \
        if n_chat_batches else []
    if len(spec.env_names()) > 1:  # mix the environments within every batch
        import random

        random.Random(spec.seed).shuffle(chat)
        random.Random(spec.seed + 1).shuffle(plain)
    batches: list[list[list[int]]] = []
    for step in range(spec.pretrain_steps):
        k = step // 2
        batches.append(chat[k * chat_size:(k + 1) * chat_size] if step % 2 else
                       plain[k * plain_size:(k + 1) * plain_size])
    return batches
