"""The configuration's sections: one frozen dataclass per table of a config file, a docstring under every field.

These are the settings themselves, not a description of them: the rollout side, the learner and the server take
the section they need as it is (``ctxrl.config`` loads them from TOML, ``ctxrl.run.validate`` checks them). This
module sits at the bottom of the package's layers, beside ``ctxrl.settings``, so that any package may take a
section as a parameter; it imports nothing else of ctxrl but the prompts its defaults quote.

Each field's metadata says what the hand-kept lists once held: the values a number may take (``POSITIVE``,
``NON_NEGATIVE``, ``in_range``, ``ALLOWS_INF``: ``ctxrl.settings`` checks them) and whether it may change on
``--resume`` (``RESUMABLE``, from ``ctxrl.settings``; a section whose every field may says ``resumable:
ClassVar[bool] = True``; ``ctxrl.config.resumable_keys`` collects them, and a resumed run compares the rest).
A field that only one component reads belongs in that component's own ``Settings`` (``[algo.gae]``,
``[context.summarize]``: ``ctxrl.settings``), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ctxrl.prompts import REFLECTION_INSTRUCTION
from ctxrl.settings import NON_NEGATIVE, POSITIVE, RESUMABLE, in_range

__all__ = ["RESUMABLE", "SECTIONS", "SHARED", "AlgoConfig", "ContextConfig", "CurriculumConfig", "DistributedConfig",
           "EnvConfig", "EvalConfig", "LoRAConfig", "MetaConfig", "ModelConfig", "ReportConfig", "RewardConfig",
           "RolesConfig", "RolloutConfig", "RunConfig", "SFTConfig", "TrainConfig"]


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    """HF hub name or local checkpoint directory of the policy, a ``.gguf`` file (converted once to a cached
    checkpoint), a named real model installed from a Python package (``smollm2-135m-instruct``), or ``tiny`` (built
    locally); docs/real-models.md."""
    dtype: str = "float32"
    """Dtype of the weights: float32, bfloat16 or float16. The policy (and a LoRA run's frozen base and adapters)
    and the engine's copy hold and compute in it; with ``train.master_weights = "float32"`` the optimiser keeps
    float32 master weights of what trains (docs/precision.md)."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
    gpu_memory_fraction: float = field(default=0.0, metadata={**RESUMABLE, **in_range(0.0, 1.0)})
    """Share of the CUDA device's total memory this run may use, for several runs on one card: torch's allocator
    is capped at it (less the CUDA context) and the fast engine's KV pool, its prefill chunk and the learner's
    tokens per micro-batch are sized to fill it. 0 = no cap: the run plans what it needs, with micro-batches of
    4096 tokens (fewer where their activations would pass 4 GiB) unless train.max_tokens_per_microbatch says
    otherwise. A run that cannot fit stops before it loads the model, naming the settings to change. Ignored on
    the CPU (docs/performance.md)."""
    chat_template: str = ""
    """Optional Jinja file (or template text) replacing the tokenizer's chat template."""
    tool_format: str = "auto"
    """How the policy writes tool calls: ``hermes`` (``<tool_call>{json}</tool_call>``: Qwen2.5, Qwen3, Hermes),
    ``llama3_json`` (bare ``{"name": ..., "parameters": ...}``: Llama 3.x), ``mistral`` (``[TOOL_CALLS]``),
    ``pythonic`` (``[f(a=1)]``: Llama 3.2/4), or ``auto`` (chosen from the chat template; a ChatML template that
    shows no tool markers gets ``hermes``; docs/tool-formats.md). A template that ignores ``tools`` gets the tool
    schemas and the format's calling convention in its system turn."""


@dataclass(frozen=True)
class EnvConfig:
    name: str = "calculator"
    """Registered environment name, ``package.module:Class``, or a family's ``PREFIX:NAME`` from another package:
    ``reasoning_gym:chain_sum`` (docs/reasoning-gym.md), ``verifiers:ID`` (docs/verifiers.md); its settings are
    the table ``[env.PREFIX]``."""
    max_turns: int = field(default=4, metadata=POSITIVE)
    """Assistant turns per episode before it is truncated (``max_turns``)."""
    data: str = ""
    """Task file for environments built from data (``jsonl_tools``): a JSONL path."""
    mcp_servers: list[str] = field(default_factory=list)
    """MCP servers whose tools the policy gets beside the environment's own (docs/mcp.md): each the URL of a
    streamable-HTTP server (``http://127.0.0.1:8000/mcp``) or a command line that starts one over stdio (``python
    my_server.py``; ``python`` is the interpreter running ctxrl; leading ``NAME=value`` words set its environment).
    Needs the ``mcp`` extra; ``ctxrl tools CONFIG`` lists what the policy will see."""
    mcp_tools: str = ""
    """Comma-separated names of the MCP servers' tools to offer; empty: every tool they list."""
    mcp_timeout_s: float = field(default=30.0, metadata=POSITIVE)
    """Deadline of one MCP tool call: past it the call is cancelled, and the model reads ``Error: tool NAME timed
    out``."""
    mcp_restarts: int = field(default=3, metadata=NON_NEGATIVE)
    """How many times in a run an MCP server that died is started again (reconnected, over HTTP); the episode whose
    call it died in is errored (``errors_tool_server``)."""


@dataclass(frozen=True)
class RolloutConfig:
    tasks_per_step: int = field(default=8, metadata=POSITIVE)
    """Distinct training tasks per RL step."""
    group_size: int = field(default=8, metadata=POSITIVE)
    """Episodes sampled per task (the GRPO group)."""
    temperature: float = field(default=0.7, metadata=NON_NEGATIVE)
    """Sampling temperature for training rollouts (the learner uses the same one). Below 1 the
    tiny model's number copying is less noisy, so more rollouts earn a reward."""
    top_p: float = field(default=1.0, metadata=in_range(0.0, 1.0, low_open=True))
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = field(default=0, metadata=NON_NEGATIVE)
    """Top-k sampling (0 = off); applied before top-p, as HF and vLLM do."""
    stop_ids: list[int] = field(default_factory=list)
    """Token ids that end a turn besides the tokenizer's end-of-turn token and every ``eos_token_id`` of the model's
    ``generation_config.json`` (kept in the turn, as sampled)."""
    stop_strings: list[str] = field(default_factory=list)
    """Texts that end a turn as soon as the sampled text contains one (kept in the turn). The turn is over, not cut
    off: the episode goes on, with the end-of-turn token added after it as context (mask 0)."""
    max_new_tokens: int = field(default=48, metadata=POSITIVE)
    """Tokens one assistant turn may sample before it is cut off (``max_new_tokens``)."""
    max_total_tokens: int = field(default=512, metadata=POSITIVE)
    """Tokens of a whole episode (prompt, turns, observations) (``max_total_tokens``)."""
    max_batch_size: int = field(default=0, metadata=NON_NEGATIVE)
    """Largest batch of concurrent requests the engine decodes together (the fast engine's number of cache slots).
    0 = sized by the run: on CUDA a slot for every request in flight (a step's episodes, an evaluation's), as many
    as a share of the card holds (docs/performance.md); elsewhere 128."""
    engine: str = "auto"
    """Which engine samples: ``hf`` (batched HF forward passes, the CPU and reference engine), ``fast`` (continuous
    batching over a slot KV cache with prefix reuse and CUDA graphs; Llama, Qwen2/2.5/3 and Mistral layouts, no
    LoRA) or ``auto`` (``fast`` on CUDA where it can run this model, else ``hf``). See docs/engine.md."""
    sandbox_workers: int = field(default=8, metadata={**RESUMABLE, **POSITIVE})
    """Most sandboxed Python interpreters (the ``python`` tool) running at once in a rollout worker, each allowed
    its memory limit (512 MB); calls beyond it wait for a free one, within their tool timeout."""
    episode_timeout_s: float = field(default=300.0, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Wall-clock deadline of one episode (environment set-up, model time, tool time); past it the
    episode is marked errored (``deadline``) and left out of the loss. 0 = no deadline."""
    max_error_rate: float = field(default=0.5, metadata={**RESUMABLE, **in_range(0.0, 1.0)})
    """Abort the run when more than this fraction of a step's episodes errored (crash or deadline)."""
    partial_step_tokens: int = field(default=0, metadata=NON_NEGATIVE)
    """Partial rollouts (0 = off: a step waits for every episode it started): the tokens one episode may sample in
    one RL step. An episode past them takes its next turn in the next step, on the new weights, its earlier tokens
    keeping the log-probs and policy version they were sampled with; a group trains when all its members have
    finished, and a step starts new groups only up to tasks_per_step in flight. Needs algo.old_logprobs =
    "recompute" and episode_timeout_s = 0; a checkpoint keeps no episode in flight (docs/scaling.md)."""


@dataclass(frozen=True)
class ContextConfig:
    manager: str = "full"
    """What the model sees as an episode grows: ``full`` (everything), ``window`` (drop the oldest whole
    turns when the next turn would not fit), ``summarize`` (SUPO / ReSum: the policy summarises its
    history when the next turn would not fit, and goes on from the summary), ``fold``
    (Context-Folding: ``branch(goal)`` / ``return(result)`` tools; a branch's tokens stay out of the parent),
    ``select`` (ECHO-style: the policy names the earlier turns to keep verbatim when the next turn would not fit),
    or any manager registered with ``ctxrl.rollout.managers.register_manager``. A manager's own settings are its
    table: ``[context.summarize]``, ``[context.select]``, ``[context.fold]``."""
    max_context_tokens: int = field(default=0, metadata=NON_NEGATIVE)
    """Working-context budget in tokens for ``window``, ``summarize`` and ``select`` (must not exceed
    rollout.max_total_tokens)."""
    budget_start_tokens: int = field(default=0, metadata=NON_NEGATIVE)
    """Budget curriculum (BACM-style): start training at this budget and shrink linearly to
    max_context_tokens over budget_steps RL steps (0 = no curriculum; evaluation always uses max_context_tokens)."""
    budget_steps: int = field(default=20, metadata=NON_NEGATIVE)
    """RL steps over which the budget shrinks from budget_start_tokens to max_context_tokens."""


@dataclass(frozen=True)
class MetaConfig:
    num_attempts: int = field(default=1, metadata=POSITIVE)
    """Attempts per trial in training (1 = off: single-episode RL). A trial is up to K attempts at one task, with
    the environment's feedback (and a reflection) between them; above 1 it needs algo.advantage=meta."""
    eval_attempts: int = field(default=0, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Attempts per trial at evaluation (0 = num_attempts). Above 1 evaluation plays greedy trials and logs
    success_at_k / success_by_k; its ``success`` stays attempt 1's (zero-shot, as a single episode)."""
    eval_trials: int = field(default=1, metadata={**RESUMABLE, **POSITIVE})
    """Trials per task at evaluation; pass@k of independent first attempts needs at least k (and
    eval.temperature > 0: greedy trials of one task are identical)."""
    carry: str = "reflections"
    """What an attempt carries of the earlier ones: ``reflections`` (a feedback line and the reflection of each)
    or ``attempts`` (each earlier attempt in full, with its feedback)."""
    reflect: bool = True
    """Sample a reflection (trained) after each attempt that another follows; false = plain retries."""
    stop_on_success: bool = True
    """End a trial at its first successful attempt."""
    reflection_instruction: str = REFLECTION_INSTRUCTION
    """The user message, after the feedback line, that asks for a reflection."""
    reflection_max_tokens: int = field(default=64, metadata=POSITIVE)
    """Tokens one reflection may take."""
    max_context_tokens: int = field(default=0, metadata=NON_NEGATIVE)
    """Budget of an attempt's opening (task + carried history) in tokens: the oldest attempts are dropped until it
    fits (0 = only the room rollout.max_total_tokens leaves for a turn)."""


@dataclass(frozen=True)
class SFTConfig:
    resumable: ClassVar[bool] = True  # every field may change on --resume (RESUMABLE)

    enabled: bool = True
    """Warm-start with supervised fine-tuning on the environment's scripted solutions."""
    demos: int = field(default=2000, metadata=POSITIVE)
    """Number of demonstration episodes."""
    shortcut_fraction: float = field(default=0.65, metadata=in_range(0.0, 1.0))
    """Fraction of demos that answer without the tool (the env's ``shortcut``): imperfect on purpose.
    Above one half, the greedy warm-started policy prefers answering unaided; RL has to find the tool."""
    redundant_fraction: float = field(default=0.0, metadata=in_range(0.0, 1.0))
    """Fraction of demos that solve the task with one tool call too many (the env's ``redundant``: search_qa
    searches the answer again, python_math runs its code twice): a warm start that over-calls, for testing
    what OTC's reward (reward.otc_weight) cuts. Drawn after the shortcut's share; the two may not exceed 1."""
    other_worlds: bool = True
    """Draw demos from the env's ``pretraining_variant`` where it has one (``search_qa``: other invented
    worlds), so the warm start teaches the skill and not the training split's answers."""
    context_demos: str = "auto"
    """Play demos under the run's context manager: ``auto`` does so when context.manager=summarize and the env
    has a ``summary`` hook (kv_chain, search_qa), so demos show summary requests answered with the env's scripted
    summaries (``select``: a ``select`` hook, or selections derived from ``summary``); ``on`` insists (a config
    error if the env has no hook); ``off`` plays full-context demos."""
    trial_demos: float = field(default=0.0, metadata=in_range(0.0, 1.0))
    """Fraction of the demos played as scripted trials: a failed attempt, its reflection, then the solution
    (ctxrl.meta.trial_demos; only the reflection and the solution train). Teaches the format of trials before
    meta-RL; needs the env's ``failure`` and ``reflection`` hooks (minesweeper, bandit)."""
    format_demos_env: str = ""
    """A format-only warm start: another environment whose demos, played under the run's context manager
    with its scripted summaries (selections), join this environment's demos, which then use the full context. The
    policy sees how to summarise, never what to keep on this task: what its own summaries hold here is RL's to
    learn. Empty: the run's own environment shows the manager (``context_demos``)."""
    format_demos: int = field(default=0, metadata=NON_NEGATIVE)
    """How many demos of ``format_demos_env`` join the warm start (besides ``demos`` of the run's environment)."""
    format_demos_budget: int = field(default=0, metadata=NON_NEGATIVE)
    """The working-context budget those demos play under (its scripted summaries need one that fits that
    environment's turns); 0 = the run's ``context.max_context_tokens``."""
    epochs: int = field(default=2, metadata=POSITIVE)
    """Passes over the demonstrations."""
    batch_size: int = field(default=32, metadata=POSITIVE)
    """Sequences per optimiser step (a demo that summarised gives one per segment)."""
    lr: float = field(default=1e-3, metadata=NON_NEGATIVE)
    """AdamW learning rate (linear warm-up over 5% of steps, then cosine decay)."""


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"
    """Advantage estimator: ``grpo`` (group-normalised outcome), ``dr_grpo`` (centred only),
    ``rloo`` (leave-one-out), ``reinforce_pp`` (discounted turn-reward returns, whitened over the
    batch), ``turn_grpo`` (group-normalised per-turn returns), ``gae`` (PPO with a learned
    critic, ``[algo.gae]``), ``meta`` (credit across the attempts of a trial, ``[algo.meta]``; docs/meta.md),
    ``distill`` (on-policy distillation: a teacher's per-token reverse KL, ``[algo.distill]``;
    docs/distillation.md), or any estimator registered with ``ctxrl.algo.estimators.register_estimator``; see
    docs/algorithms.md."""
    gamma: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Discount per sampled token (``reinforce_pp``, ``gae``) or per turn (``turn_grpo``)."""
    loss: str = "ppo_clip"
    """Policy loss, a registered name (``ctxrl.algo.policy_losses``): ``ppo_clip``, ``gspo``, ``cispo``, ``gmpo``,
    ``sapo``, ``clip_cov``, ``kl_cov``, ``dppo_tv``, ``dppo_kl`` (docs/algorithms.md); its own settings in
    ``[algo.NAME]``."""
    clip_low: float = field(default=0.2, metadata=NON_NEGATIVE)
    """PPO lower clip: ratios below 1 - clip_low stop the gradient of negative advantages (the clip range of
    ``ppo_clip``, ``gspo`` (use bounds near 3e-4 / 4e-4) and ``clip_cov``; other losses have their own)."""
    clip_high: float = field(default=0.2, metadata=NON_NEGATIVE)
    """PPO upper clip (DAPO's clip-higher raises it, e.g. 0.28)."""
    kl_coef: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Weight of the KL(policy || reference) term in the loss (0 = no reference model)."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3."""
    kl_placement: str = "loss"
    """Where the KL to the reference goes: ``loss`` (a term of the policy loss) or ``reward``
    (``-kl_coef * KL`` on every sampled token's reward, before the advantages; REINFORCE++ / PPO style)."""
    entropy_coef: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Entropy bonus weight (0 = off)."""
    world_model_coef: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Weight of ECHO's world-model loss (0 = off; the paper's 0.05): the policy also learns to predict the
    environment's replies, the mean cross-entropy of the tokens the environment wrote (tool output with its template
    tokens; never the prompt nor a sampled token), over the mini-batch's environment tokens
    (ctxrl/algo/world_model.py). Logged as world_model_nll. Not with train.shared_prefix=auto yet."""
    agg: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: leave out groups whose rewards all agree and sample more tasks to refill."""
    dynamic_sampling_rounds: int = field(default=3, metadata=POSITIVE)
    """Most extra rollout rounds per step that dynamic sampling may spend refilling the batch."""
    void_turn_filter: bool = False
    """SimpleTIR: leave trajectories with a void turn (no tool call, no answer) out of the update."""
    old_logprobs: str = "behaviour"
    """The PPO "old" policy: ``behaviour`` (the sampler's log-probs, exact in fp32) or ``recompute``
    (one extra learner pass before the update; logs the sampler/learner mismatch)."""
    tis_cap: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Truncated importance sampling: weight each token by min(learner_old / behaviour, cap) (0 = off;
    needs ``old_logprobs = "recompute"``; e.g. 2.0 for bf16 rollouts)."""
    offpolicy: str = ""
    """An off-policy correction between the learner's recomputed old log-probs and the behaviour ones, a registered
    name (``ctxrl.algo.offpolicy``): ``token_tis``, ``sequence_tis``, ``sequence_mis``, ``geometric_mis``,
    ``icepop``, ``m2po``, its settings in ``[algo.NAME]``; empty: none. Applied once per update over the whole
    batch (a rejected sequence leaves the loss and its denominators); needs ``old_logprobs = "recompute"`` and
    replaces ``tis_cap``, the older token TIS (docs/algorithms.md)."""


@dataclass(frozen=True)
class CurriculumConfig:
    kind: str = "fixed"
    """Which training tasks and turn limit per step: ``fixed`` (the env's train distribution),
    ``horizon`` (turn cap raised in stages, ScalingInter-RL: ``[curriculum.horizon]``), ``self_paced`` (prefer
    contexts of intermediate success, SPaCE-like: ``[curriculum.self_paced]``), or any curriculum registered with
    ``ctxrl.tasks.curriculum.register_curriculum``; see ctxrl/tasks/curriculum.py."""


@dataclass(frozen=True)
class RewardConfig:
    """The reward's terms; a judge's settings are its own table, ``[reward.judge]`` (``judge.spec.JudgeSettings``)."""

    outcome: float = 1.0
    """Weight of the environment's own reward (its correctness signal)."""
    overlong_buffer: int = field(default=0, metadata=NON_NEGATIVE)
    """DAPO overlong shaping: tokens before ``rollout.max_total_tokens`` where a linear penalty starts (0 = off)."""
    overlong_weight: float = 1.0
    """Weight of the overlong penalty (which runs from 0 to -1)."""
    otc_weight: float = 0.0
    """Weight of OTC's tool-efficiency reward (correctness scaled by closeness to the group's fewest
    successful tool calls; 0 = off). Pure OTC-GRPO: ``reward.outcome=0 reward.otc_weight=1``."""
    otc_c: float = field(default=1.0, metadata=NON_NEGATIVE)
    """OTC's smoothing constant c (used when no episode of the group succeeded with a known count)."""
    format_weight: float = 0.0
    """Weight of the format reward: 1 when no turn made a malformed or failing tool call (0 = off)."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=40, metadata={**RESUMABLE, **NON_NEGATIVE})
    """RL steps (each: rollout, advantages, updates)."""
    objective: str = "rl"
    """What each step trains on: ``rl`` (rollouts, advantages, the policy loss) or ``sft``, the SFT-only control of
    an RL claim: each step trains instead on fresh demos of the warm start's mix, as many optimiser steps as an RL
    step takes (``ppo_epochs`` x ``mini_batches``, each a batch of ``sft.batch_size``) at ``train.lr``, with the
    same evaluations. An RL effect is RL's own only beyond this control (docs/experiments/README.md)."""
    lr: float = field(default=1e-4, metadata=NON_NEGATIVE)
    """AdamW learning rate for RL (Adam moves every weight by about this much per step even when
    few rollouts earn a reward, so keep it well below the warm start's)."""
    weight_decay: float = field(default=0.0, metadata=NON_NEGATIVE)
    """AdamW weight decay."""
    max_grad_norm: float = field(default=1.0, metadata=POSITIVE)
    """Gradient clipping by global norm (a norm of 0 would zero every gradient, a negative one reverse it)."""
    ppo_epochs: int = field(default=1, metadata=POSITIVE)
    """Passes over each rollout batch."""
    mini_batches: int = field(default=2, metadata=POSITIVE)
    """Optimiser steps per pass (the batch is split into this many mini-batches)."""
    micro_batch_size: int = field(default=32, metadata={**RESUMABLE, **POSITIVE})
    """Sequences per forward/backward (gradient accumulation inside a mini-batch). Through the flat forward pass
    (train.flat_forward) under a token budget the budget alone bounds a micro-batch: its memory follows its tokens,
    not its rows."""
    eval_every: int = field(default=10, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Evaluate on held-out tasks every N steps (0 = only at the end)."""
    checkpoint_every: int = field(default=0, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Save a resumable checkpoint every N RL steps (0 = only the final weights, not resumable)."""
    keep_checkpoints: int = field(default=3, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Resumable step checkpoints kept (the oldest are deleted; 0 = keep all)."""
    max_consecutive_skips: int = field(default=5, metadata={**RESUMABLE, **POSITIVE})
    """Abort after this many RL steps in a row whose every update was skipped (non-finite loss or gradient)."""
    master_weights: str = "float32"
    """What the optimiser updates: ``float32`` (with model.dtype bfloat16/float16, AdamW keeps float32 master copies
    of the trained weights and float32 moments, rounds them into the model after each step, and float16 gets loss
    scaling) or ``model`` (AdamW updates the model.dtype weights directly: bf16 loses small updates;
    docs/precision.md)."""
    max_tokens_per_microbatch: int = field(default=0, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Token budget of one forward/backward: micro-batches are packed by length so that rows x longest row stays
    within it (and at most micro_batch_size rows, except through the flat forward pass); 0 = on CUDA the run's
    memory plan chooses it (up to 32768 tokens, within a share of the card: docs/performance.md), elsewhere
    micro_batch_size rows at a time."""
    logprob_chunk_tokens: int = field(default=1024, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Log-probs and entropy are computed from the final hidden states in chunks of this many positions, only
    where the loss needs them, so full-vocabulary logits are never held for a whole sequence (gradients equal
    the full computation); 0 = the model's full logits."""
    pack_sequences: bool = field(default=False, metadata=RESUMABLE)
    """Run the policy's forward and backward passes on sequences packed without padding (several per row, each
    with its own positions and a block-diagonal mask; docs/performance.md). The loss is computed as without
    packing; it saves the compute spent on padding when a micro-batch's lengths differ."""
    flat_forward: str = field(default="auto", metadata=RESUMABLE)
    """The learner's forward pass: ``auto`` (on CUDA, for Llama-layout models: Llama, Qwen2/2.5/3, Mistral) runs the
    micro-batch's sequences laid end to end without padding through ctxrl's own decoder forward (variable-length
    flash attention, compiled norms and activations; checked against the HF forward pass once), for models at most
    1024 wide with its layers' forward and backward passes replayed as CUDA graphs in training (``graphed``), else
    HF's forward pass; ``on``
    forces the flat pass, eager (an error if the model cannot), ``compiled`` is ``on`` with each decoder layer
    compiled as one graph (fewer kernel launches; a slower first step), ``graphed`` is ``on`` with the layers
    captured as CUDA graphs (CUDA only; a micro-batch is padded to the captured size), ``off`` always uses HF's.
    Same loss and gradients up to kernel rounding (docs/performance.md)."""
    gradient_checkpointing: bool = field(default=False, metadata=RESUMABLE)
    """Recompute each layer's activations in the backward pass instead of keeping them: less memory, ~30% more
    compute."""
    shared_prefix: str = field(default="off", metadata=RESUMABLE)
    """Train rows that share a prefix (a GRPO group's prompt, a meta-RL trial's earlier attempts, a segmented
    episode's kept context) as one packed token trie, the prefix's forward and backward computed once: ``auto``
    shares each tree the FLOP plan says pays (ctxrl/learner/shared_prefix), each whole in one micro-batch, and runs
    the other rows as before; ``off`` never shares. Same loss and gradients up to kernel rounding. A tree runs HF's
    forward pass with an ancestor mask (FlexAttention on CUDA, else sdpa or eager attention), never the flat pass
    (flat_forward must be auto or off); where the other rows run flat, a tree must save 2.5x its FLOPs to be shared
    (on one H200 that was meta-RL trials only); learner_shared_prefix_rows says how many rows shared
    (docs/performance.md)."""
    mini_batch_order: str = field(default="shuffled", metadata=RESUMABLE)
    """How an update's rows are cut into ``mini_batches``: ``shuffled`` (a fresh random order every epoch), or
    ``prefix`` (rows sorted by their tokens, so rows that share a prefix, a group's prompt or a trial's earlier
    attempts, are neighbours; cut into consecutive mini-batches, taken in a random order every epoch). With
    ``shared_prefix = auto`` and more than one mini-batch, ``prefix`` keeps a group in one mini-batch where the cuts
    allow, so it is shared whole. Not the same numbers as ``shuffled``: other rows meet in a mini-batch."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = field(default=0, metadata=NON_NEGATIVE)
    """LoRA rank (PEFT); 0 = full fine-tuning. Only the adapters train; the base stays frozen in model.dtype."""
    alpha: float = field(default=32.0, metadata=POSITIVE)
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    dropout: float = field(default=0.0, metadata=in_range(0.0, 1.0))
    """Dropout on the adapters' input. Keep it 0 for RL: dropout makes the learner's log-probs differ from the
    sampler's, which biases the PPO ratio."""
    target_modules: str = "all-linear"
    """Modules that get adapters: ``all-linear`` (every linear layer but the output head) or comma-separated
    module names (``q_proj,k_proj,v_proj,o_proj``)."""
    export_merged: bool = field(default=True, metadata=RESUMABLE)
    """Also write the base with the adapters merged in (``checkpoints/final-merged``), ready to serve."""


@dataclass(frozen=True)
class EvalConfig:
    resumable: ClassVar[bool] = True  # every field may change on --resume (RESUMABLE)

    tasks: int = field(default=100, metadata=POSITIVE)
    """Tasks per split for evaluation."""
    temperature: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Evaluation sampling temperature (0 = greedy)."""
    seed: int = field(default=1234, metadata=NON_NEGATIVE)
    """Seed of the evaluation task sample (fixed so before/after compare the same tasks)."""


SHARED = "shared"
"""The policy of a role that ``roles.policies`` leaves out: the run's own (``ctxrl.rollout.spec.POLICY_KINDS``)."""


@dataclass(frozen=True)
class RolesConfig:
    policies: list[str] = field(default_factory=list)
    """Who plays each role of a multi-role environment, as ``ROLE=POLICY``: ``shared`` (the run's policy, the
    default for a role left out), ``scripted:NAME`` (the environment's scripted player NAME) or ``frozen:PATH`` (a
    checkpoint of this model that never trains). Pinned roles are played and logged, never trained
    (docs/multi-agent.md)."""
    rewards: str = "env"
    """How the seats' rewards relate: ``env`` (as the environment gives them), ``zero_sum`` (each seat's minus the
    mean of the seats'), ``team`` (the mean for every seat: cooperative)."""
    eval_opponents: list[str] = field(default_factory=list)
    """Policies (``scripted:NAME``, ``frozen:PATH``) the learner plays against in every evaluation, in each role
    in turn: win rate with a 95% interval per opponent. Empty: evaluation plays self-play matches."""

    def policy(self, role: str, overrides: dict[str, str] | None = None) -> str:
        """The policy that plays ``role``: ``overrides`` (a request's), else ``policies``', else ``shared``."""
        pinned = dict(pair.split("=", 1) for pair in self.policies)
        return (overrides or {}).get(role) or pinned.get(role) or SHARED


@dataclass(frozen=True)
class RunConfig:
    name: str = field(default="run", metadata=RESUMABLE)
    """Run name; the run directory defaults to ``runs/<name>-<timestamp>``."""
    seed: int = field(default=0, metadata=NON_NEGATIVE)
    """Seed for tasks, sampling and initialisation (numpy takes no negative seed)."""
    progress: bool = field(default=True, metadata=RESUMABLE)
    """Show a live progress bar."""
    plugins: str = field(default="", metadata=RESUMABLE)
    """Comma-separated modules imported before the configuration is checked: where your own environments, context
    managers and estimators register themselves (looked up on PYTHONPATH and in the working directory)."""
    samples_per_step: int = field(default=4, metadata={**RESUMABLE, **NON_NEGATIVE})
    """Decoded episodes written to samples.jsonl per step."""


@dataclass(frozen=True)
class ReportConfig:
    resumable: ClassVar[bool] = True  # every field may change on --resume (RESUMABLE)

    sinks: str = "jsonl"
    """Where metrics go, comma-separated: ``jsonl`` (metrics.jsonl and samples.jsonl, always), ``tensorboard``
    (RUN/tensorboard) and ``wandb`` (RUN/wandb), each installed from a clone of ctxrl as an extra: ``pip install -e
    '.[tensorboard]'``, ``pip install -e '.[wandb]'``."""
    wandb_project: str = "ctxrl"
    """The Weights & Biases project a run logs to."""
    wandb_mode: str = "offline"
    """``offline`` (no account needed; ``wandb sync`` uploads later), ``online`` or ``disabled``."""


@dataclass(frozen=True)
class DistributedConfig:
    backend: str = field(default="none", metadata=RESUMABLE)
    """Where rollouts run: ``none`` (in this process) or ``ray`` (``rollout_workers`` Ray actors, each with its
    own engine; ``ctxrl train --distributed ray``; needs ``pip install -e '.[ray]'``; docs/scaling.md)."""
    rollout_workers: int = field(default=2, metadata={**RESUMABLE, **POSITIVE})
    """Ray rollout actors; a request's tasks are split among them (the episodes are those of one process)."""
    address: str = field(default="", metadata=RESUMABLE)
    """Ray cluster to join (``ray start --head`` prints it; ``auto`` finds a local one); empty: a local Ray."""
    max_staleness: int = field(default=0, metadata=NON_NEGATIVE)
    """How many policy versions older than the learner's an episode may be (eta). 0: synchronous on-policy
    training. On Ray, 1 or more: the next step's rollouts are generated while this step trains; episodes older
    than eta are dropped and counted. In one process: the engine plays weights exactly eta versions behind the
    learner's (the off-policy gap reproduced, no time saved; docs/scaling.md). Either needs
    ``algo.old_logprobs = "recompute"`` (the decoupled PPO objective)."""
    timeout_s: float = field(default=600.0, metadata={**RESUMABLE, **POSITIVE})
    """Longest wait for a rollout worker (a request, a weight load, a restart) before the run stops."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "env": EnvConfig, "rollout": RolloutConfig, "context": ContextConfig, "meta": MetaConfig,
    "sft": SFTConfig, "algo": AlgoConfig, "reward": RewardConfig, "curriculum": CurriculumConfig,
    "train": TrainConfig, "lora": LoRAConfig, "eval": EvalConfig, "run": RunConfig, "report": ReportConfig,
    "distributed": DistributedConfig, "roles": RolesConfig,
}
"""Each section's table name and class, in the order a config file lists them (``ctxrl.config.Config``'s fields)."""
