"""A run's GPU memory, planned from its numbers before anything large is allocated.

``plan_memory(run)`` takes plain numbers (``RunSizes``: the model's shape from its HF config, the
dtype, what trains, the rollout and learner settings, the card's size and ``model.gpu_memory_fraction``)
and returns a ``MemoryPlan``: bytes for each part of the run, the fast engine's KV pool (slots x
positions) and prefill chunk, and the learner's tokens per micro-batch. A run's build computes it once
on CUDA (``ctxrl.run.build.plan_memory``); on the CPU there is no plan.

What is counted (bytes; ``b`` is ``model.dtype``'s size, ``N`` the parameters):

- **weights**: the policy ``N b``, the engine's copy (``N b``; a LoRA run's engine shares the base and
  copies its adapters), the KL reference (``N b`` with ``algo.kl_coef > 0``; a LoRA run's is its own base),
  the critic (``N b``, ``algo.advantage = gae``), a distillation teacher and a local judge on the same card (their
  own sizes and dtypes);
- **optimiser**: per trained parameter 16 bytes with float32 masters under a 2-byte ``model.dtype``
  (master 4, float32 gradient 4, two moments 8), else ``3 b`` (gradient and two moments);
- **KV pool**: ``slots x positions x 2 x layers x kv_heads x head_dim x b``, and the decode step's
  logits (``slots x vocab x 4 x 4``: float32 logits, probabilities and the sampler's temporaries, held
  in the CUDA graphs' pool);
- **learner**: activations per token of a micro-batch (below) times its tokens, plus one chunk of the
  output head (``logprob_chunk_tokens x vocab x (2 b + 8)``: the logits and their gradient in the model's
  dtype, two float32 temporaries); with ``logprob_chunk_tokens = 0`` that cost is per token;
- **workspaces**: ``RUNTIME_BYTES`` that no formula here counts (cuBLAS, compiled kernels, CUDA graph pools);
- **headroom**: ``HEADROOM`` of the budget (``CAPPED_HEADROOM`` under a cap), for the caching allocator's
  fragmentation and the transient tensors the formulas leave out.

The fast engine's prefill does not run while the learner does, so it uses the learner's room: its
chunk is as many tokens as one layer's activations of them fit there (at most ``PREFILL_TOKENS``).

**Activations per token** (Llama layout, no gradient checkpointing), the tensors each decoder layer
saves for its backward pass, in elements: ``4 H + 3 q + 3 kv + 4 I`` with ``H`` the hidden size,
``q = heads x head_dim``, ``kv = kv_heads x head_dim``, ``I`` the MLP's width. That is the two RMSNorms'
inputs and outputs (``4 H``); the projected q, k, v, the rotated q and k, and the attention output
(``3 q + 3 kv``); the MLP's gate and up outputs, the SiLU and the product fed to the down projection
(``4 I``). In float32 add ``heads x T`` (``T = rollout.max_total_tokens``): no flash kernel takes
float32, so attention runs PyTorch's math kernel, which keeps each head's softmax. Per token:
``(layers x that + 3 H) x b`` (the ``3 H``: the embedding, the final norm, the hidden states gathered
for the output head). With ``train.gradient_checkpointing`` each layer keeps only its input:
``(layers x H + one layer's + 3 H) x b``. The flat forward pass's MLP (``ctxrl.models.gated_mlp``) keeps the gate
and up outputs alone: ``2 I`` instead of ``4 I`` (measured, Qwen2.5-0.5B's shape on an H100: 0.79 MB a token
between 8k- and 32k-token micro-batches, the formula's figure, against 1.0 MB before). A KL reference in
the loss adds one layer's worth (its forward pass runs while the policy's activations are held).
Assumptions: in bf16 / fp16 attention is a flash kernel (no ``T x T`` scores), float32 norm statistics
and LoRA's rank-sized intermediates are negligible, the backward pass's own transients fit the headroom.
Measured slopes (peak allocated between 2048- and 8192-token micro-batches, a random-init model of
SmolLM2-135M's shape, an H100, before the lean MLP): 0.46 MB per token in bf16 through ctxrl's flat
forward pass (the formula then: 0.65 MB) and 1.89 MB in float32 through HF's (the formula: 1.85 MB).

**The budget.** With ``model.gpu_memory_fraction = f > 0`` torch's allocator is capped at
``f x card - CUDA_CONTEXT_BYTES`` (the CUDA context lives outside it) and the plan fills that: the
fixed parts, one micro-batch of the longest row, the KV pool up to its slots (never below
``MIN_KV_SLOTS``), then the learner's tokens up to what a micro-batch can hold. With ``f = 0`` (the
default) there is no cap: the run plans what makes its step fastest, within shares of the card (not of
what happens to be free, so the same run plans the same sizes each time): micro-batches of
``DEFAULT_LEARNER_TOKENS`` tokens, fewer where their activations would pass ``ACTIVATION_SHARE`` of the
card (at least ``DEFAULT_ACTIVATION_BYTES``), and with ``rollout.max_batch_size = 0`` (the default) a KV
slot for every request in flight, as many as ``KV_SHARE`` of the card holds. A scheduler that runs N
runs a card sets ``CTXRL_GPU_SHARE=1/N`` (``experiments/batch.py`` does) and the shares are of that part.
On the flat forward pass (CUDA, bf16 / fp16, a Llama-layout model, no LoRA) a micro-batch is bounded by
its tokens alone and the MLP keeps ``2 I`` values a token (``ctxrl.models.gated_mlp``).

Either way the KV pool has no more slots than requests can be in flight at once (a training step's
episodes, or an evaluation's: a request beyond them waits for a slot), and an explicit
``train.max_tokens_per_microbatch`` is kept. A plan that cannot fit its budget, or more than the card
has free when the run starts, is a ``ConfigError`` naming the figures and the settings to change.

Not counted: up to 128 MiB of low-precision gradients waiting to be added into the float32 masters'
(``ctxrl.learner.grad_accumulate.Waiting``; on CUDA-graphed layers they are the graphs' own buffers), the HF
engine's own KV cache when it serves instead of the fast engine (sized here as if it were the pool), a padded
prefill whose rows differ much in length (its padding is not bounded by the chunk), an entropy bonus's unfused
head (``algo.entropy_coef > 0``), Ray rollout actors on the same card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ctxrl.engine.capacity import PREFILL_TOKENS
from ctxrl.errors import ConfigError
from ctxrl.learner.layer_graphs import TOKEN_STEP as GRAPH_TOKEN_STEP  # (graphed micro-batches pad to its multiples)

GIB = 2**30
MIB = 2**20

DEFAULT_LEARNER_TOKENS = 32768
"""Tokens per learner micro-batch when neither ``train.max_tokens_per_microbatch`` nor a cap says otherwise: where
the learner's speed stops growing with the micro-batch (Qwen2.5-0.5B's shape on an H100, ctxrl's flat forward pass:
22.6% MFU at 32k tokens, 12.7% at 8k, where the GPU sat idle for half of the update, waiting on the host;
docs/performance.md) ..."""
GRAPHED_LEARNER_TOKENS = 5120
"""The same where the layers replay as CUDA graphs (``RunSizes.graphed``): the host no longer launches every kernel,
so the speed stops growing at a much smaller micro-batch. Qwen2.5-0.5B's default step on an H200, one call: 3.75 s
at 23.1 GiB with 8,192 tokens, 3.83 s at 21.3 GiB with 6,144 and 3.81 s at 19.9 GiB with 5,120 (6,144 and 8,192
were within 2% of each other in two more calls; docs/performance.md, "Issue 35's targets, one call")."""
DEFAULT_ACTIVATION_BYTES = 4 * GIB
"""... or fewer, where that many tokens' activations would pass the activation budget: this, or
``ACTIVATION_SHARE`` of the card's share (``card_share``), whichever is larger."""
ACTIVATION_SHARE = 0.25
"""The share of the card (of ``CTXRL_GPU_SHARE`` of it) that a plan without a cap lets the learner's activations
take when ``train.max_tokens_per_microbatch`` is 0."""
KV_SHARE = 0.25
"""The same for the KV pool when ``rollout.max_batch_size`` is 0: as many slots as requests can be in flight, as
long as they fit this share."""
MAX_AUTO_SLOTS = 1024
"""At most this many KV slots when ``rollout.max_batch_size`` is 0."""
GPU_SHARE_VARIABLE = "CTXRL_GPU_SHARE"
"""An environment variable a scheduler sets to the share of the card each of its runs may assume (``1/N`` for N
runs a card: ``experiments/batch.py`` does); the uncapped plan sizes its parts from that share of the card, not
the whole. Not a cap: ``model.gpu_memory_fraction`` is the cap."""
MIN_KV_SLOTS = 8
"""The smallest KV pool worth having: fewer slots leave the decode step latency-bound."""
CUDA_CONTEXT_BYTES = GIB
"""Device memory a CUDA process holds outside torch's allocator (context, kernels' code): nvidia-smi's figure of a
training process less torch's reserved memory measured 0.86 GiB (torch 2.11, CUDA 13, an H200)."""
RUNTIME_BYTES = 256 * MIB
"""Workspaces no formula here counts (cuBLAS, compiled kernels, CUDA graph pools, small buffers): a tiny model's
run reserved 0.23 GiB more than its parts."""
HEADROOM = 0.10
"""Share of the budget kept free for fragmentation and workspaces the formulas leave out, where nothing caps the
allocator (a plan's estimate, not a limit: the run may pass it)."""
CAPPED_HEADROOM = 0.20
"""The same share under ``model.gpu_memory_fraction``, where the cap is a limit and fragmentation counts against it.
Measured (issue 31's first batch, H100s, SmolLM2-135M in bf16, six capped runs a card): runs that planned 10% OOMed
with 9.57 GiB allocated and 1.29 GiB reserved but unallocated under a 10.88 GiB cap: fragmentation alone took 12%.
Capped runs also turn on the allocator's expandable segments (``ctxrl.learner.sizing.memory_plan``)."""
DECODE_LOGIT_COPIES = 4
"""Float32 ``[slots, vocab]`` tensors of one decode step (logits, probabilities, the sampler's temporaries)."""
LOGIT_FLOAT32_COPIES = 2
"""Float32 ``[chunk, vocab]`` temporaries of the output head's forward / backward, besides the logits and their
gradient in the model's dtype."""
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

SETTINGS_TO_CHANGE = ("raise model.gpu_memory_fraction, or lower rollout.max_batch_size (KV slots), "
                      "rollout.max_total_tokens (positions per slot, the longest row) or "
                      "train.max_tokens_per_microbatch (the learner's micro-batch); lora.rank > 0 trains adapters "
                      "only (no full optimiser state) and train.gradient_checkpointing = true keeps one layer's "
                      "activations instead of all")


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder: its sizes and parameter count (``from_hf_config``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    parameters: int

    @classmethod
    def from_hf_config(cls, config, parameters: int) -> ModelShape:
        """The shape an HF ``PretrainedConfig`` gives (its text part, for a multimodal one); ``parameters`` counted
        elsewhere (the trainer builds the model on the ``meta`` device). A ``ValueError`` names a missing size."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                               "vocab_size") if not getattr(config, k, None)]
        if missing:
            raise ValueError(f"{type(config).__name__} has no {', '.join(missing)}")
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=int(config.num_hidden_layers), hidden=int(config.hidden_size),
                   intermediate=int(config.intermediate_size), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   vocab=int(config.vocab_size), parameters=int(parameters))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_activations(self, *, lean_mlp: bool = False) -> int:
        """Elements one decoder layer saves per token for its backward pass: ``4 H + 3 q + 3 kv + 4 I``; with
        ``lean_mlp`` (the flat forward pass's MLP, ``ctxrl.models.gated_mlp``) ``2 I`` instead of ``4 I``."""
        mlp = (2 if lean_mlp else 4) * self.intermediate
        return 4 * self.hidden + 3 * self.q_width + 3 * self.kv_width + mlp

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a Llama-layout decoder layer."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}


def lora_parameters(shape: ModelShape, rank: int, target_modules: str = "all-linear") -> int:
    """Adapter parameters: ``rank x (in + out)`` per targeted linear layer of every decoder layer. ``all-linear``
    is the seven of the Llama layout (not the output head); names this layout lacks count nothing."""
    if rank <= 0:
        return 0
    names = LLAMA_LINEARS if target_modules.strip() == "all-linear" else [
        m.strip() for m in target_modules.split(",") if m.strip()]
    shapes = shape.linear_shapes()
    return shape.layers * sum(rank * sum(shapes[n]) for n in names if n in shapes)


@dataclass(frozen=True)
class RunSizes:
    """A run's numbers that its memory depends on (``from_config`` reads them from a ``Config``)."""

    shape: ModelShape
    dtype_bytes: int
    """``model.dtype``'s size: 4, or 2 for bfloat16 / float16."""
    max_total_tokens: int
    """The longest row the learner takes (``rollout.max_total_tokens``)."""
    micro_batch_size: int
    kv_slots: int = 0
    """Slots the KV pool would have unconstrained: ``rollout.max_batch_size``, at most the requests in flight at
    once; 0 = no engine in this process (a data-parallel follower rank, Ray rollout actors)."""
    auto_slots: bool = False
    """``rollout.max_batch_size`` is 0: the plan sizes the pool (``KV_SHARE``) instead of taking ``kv_slots``."""
    kv_tokens_per_slot: int = 0
    """Positions per slot (the engine's ``slot_capacity``)."""
    max_tokens_per_microbatch: int = 0
    """The user's ``train.max_tokens_per_microbatch`` (0: the plan chooses)."""
    logprob_chunk_tokens: int = 1024
    gradient_checkpointing: bool = False
    lora_rank: int = 0
    lora_targets: str = "all-linear"
    float32_masters: bool = False
    """The optimiser keeps float32 masters of 2-byte weights (``train.master_weights = float32``)."""
    reference: bool = False
    """A KL reference is held (``algo.kl_coef > 0``)."""
    critic: bool = False
    frozen_bytes: int = 0
    """Frozen models beside the policy on the same card: a distillation teacher, a local judge."""
    device_bytes: int = 0
    """The card's total memory."""
    gpu_memory_fraction: float = 0.0
    flat: bool = False
    """The learner runs ctxrl's flat forward pass (``ctxrl.learner.flat``: CUDA, a 2-byte dtype, a Llama-layout
    model, no LoRA): the lean MLP's activations, and micro-batches bounded by tokens alone (no row cap)."""
    card_share: float = 1.0
    """The share of the card an uncapped plan sizes its automatic parts from (``GPU_SHARE_VARIABLE``)."""
    graphed: bool = False
    """The flat pass replays its layers as CUDA graphs (``ctxrl.learner.layer_graphs``): ``GRAPHED_LEARNER_TOKENS``
    by default, and the graphs' own copy of the layers' gradients (``graph_bytes``)."""

    @classmethod
    def from_config(cls, config, shape: ModelShape, *, device_bytes: int, kv_tokens_per_slot: int, engine: bool,
                    critic: bool, flat: bool = False, card_share: float = 1.0, graphed: bool = False) -> RunSizes:
        """The sizes of ``config``'s run. ``engine``: the rollout engine lives in this process; ``flat``: the learner
        will run the flat forward pass (``ctxrl.learner.sizing.expects_flat``), ``graphed``: with CUDA-graphed layers
        (``ctxrl.learner.sizing.expects_graphs``)."""
        r, t, m = config.rollout, config.train, config.meta
        eval_trials = m.eval_trials if max(m.eval_attempts, m.num_attempts) > 1 else 1
        in_flight = max(r.tasks_per_step * r.group_size, config.eval.tasks * eval_trials)
        return cls(shape=shape, dtype_bytes=4 if config.model.dtype == "float32" else 2,
                   max_total_tokens=r.max_total_tokens, micro_batch_size=t.micro_batch_size,
                   kv_slots=(min(r.max_batch_size, in_flight) if r.max_batch_size else in_flight) if engine else 0,
                   auto_slots=r.max_batch_size == 0,
                   kv_tokens_per_slot=kv_tokens_per_slot if engine else 0,
                   max_tokens_per_microbatch=t.max_tokens_per_microbatch, logprob_chunk_tokens=t.logprob_chunk_tokens,
                   gradient_checkpointing=t.gradient_checkpointing, lora_rank=config.lora.rank,
                   lora_targets=config.lora.target_modules,
                   float32_masters=t.master_weights == "float32" and config.model.dtype != "float32",
                   reference=config.algo.kl_coef > 0, critic=critic, device_bytes=device_bytes,
                   gpu_memory_fraction=config.model.gpu_memory_fraction, flat=flat, card_share=card_share,
                   graphed=flat and graphed and not t.gradient_checkpointing)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part of a run, and the sizes chosen to fit them (module docstring)."""

    budget_bytes: int
    """What torch's allocator may hold: capped there (``capped``), or the plan's own total."""
    capped: bool
    weights_bytes: int
    optimizer_bytes: int
    kv_slots: int
    kv_tokens_per_slot: int
    kv_bytes: int
    decode_bytes: int
    learner_tokens: int
    """Tokens per learner micro-batch (``train.max_tokens_per_microbatch``: the user's, or chosen)."""
    learner_bytes: int
    """Activations of the largest micro-batch the learner can form, and one output-head chunk."""
    activation_bytes_per_token: int
    prefill_tokens: int
    headroom_bytes: int
    """``HEADROOM`` of the budget, kept free."""
    device_bytes: int = 0
    gpu_memory_fraction: float = 0.0

    @property
    def planned_bytes(self) -> int:
        """The parts and the headroom: the budget itself without a cap, at most the cap with one."""
        return (self.weights_bytes + self.optimizer_bytes + RUNTIME_BYTES + self.kv_bytes + self.decode_bytes
                + self.learner_bytes + self.headroom_bytes)

    def summary(self) -> str:
        """The line the trainer prints once."""
        budget = (f"of a {gib(self.budget_bytes)} GiB cap (model.gpu_memory_fraction={self.gpu_memory_fraction:g} of "
                  f"the {gib(self.device_bytes)} GiB card, less {gib(CUDA_CONTEXT_BYTES)} GiB for the CUDA context)"
                  if self.capped else
                  "(no cap: model.gpu_memory_fraction = 0)")
        engine = (f"KV pool {self.kv_slots} slots x {self.kv_tokens_per_slot} tokens {gib(self.kv_bytes)} GiB, "
                  f"prefill {self.prefill_tokens} tokens; " if self.kv_slots else "no engine in this process; ")
        return (f"memory plan: {gib(self.planned_bytes)} GiB {budget}: weights {gib(self.weights_bytes)} GiB, "
                f"optimiser {gib(self.optimizer_bytes)} GiB, workspaces {gib(RUNTIME_BYTES)} GiB; {engine}learner "
                f"{self.learner_tokens} tokens per micro-batch ({self.activation_bytes_per_token / MIB:.2f} MiB per "
                f"token) {gib(self.learner_bytes)} GiB; headroom {gib(self.headroom_bytes)} GiB")

    def figures(self) -> dict[str, float | int | bool]:
        """The plan as a metrics row's figures (``phase = "memory"`` in metrics.jsonl)."""
        return {"planned_gib": self.planned_bytes / GIB, "budget_gib": self.budget_bytes / GIB, "capped": self.capped,
                "weights_gib": self.weights_bytes / GIB, "optimizer_gib": self.optimizer_bytes / GIB,
                "kv_slots": self.kv_slots, "kv_tokens_per_slot": self.kv_tokens_per_slot,
                "kv_gib": self.kv_bytes / GIB, "learner_tokens": self.learner_tokens,
                "learner_gib": self.learner_bytes / GIB,
                "activation_mib_per_token": self.activation_bytes_per_token / MIB,
                "prefill_tokens": self.prefill_tokens, "device_gib": self.device_bytes / GIB}


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


# -- the parts ------------------------------------------------------------------------------------------
def weights_bytes(run: RunSizes) -> int:
    """The policy, the engine's copy, the KL reference and the critic, in ``model.dtype``; frozen models beside."""
    n, b = run.shape.parameters, run.dtype_bytes
    adapters = lora_parameters(run.shape, run.lora_rank, run.lora_targets)
    total = (n + adapters) * b
    if run.kv_slots:  # the engine's copy: a LoRA engine shares the frozen base
        total += (adapters if run.lora_rank else n) * b
    if run.reference and not run.lora_rank:  # (LoRA: the reference is the base with adapters off)
        total += n * b
    if run.critic:
        total += n * b
    return total + run.frozen_bytes


def optimizer_bytes(run: RunSizes) -> int:
    """Gradients and AdamW state of what trains: 16 bytes a parameter with float32 masters, else 3 x dtype; and the
    learner's CUDA graphs' own gradients (``graph_bytes``)."""
    trained = lora_parameters(run.shape, run.lora_rank, run.lora_targets) if run.lora_rank else run.shape.parameters
    if run.critic:
        trained += run.shape.parameters
    return trained * (16 if run.float32_masters else 3 * run.dtype_bytes) + graph_bytes(run)


def graph_bytes(run: RunSizes) -> int:
    """The learner's CUDA graphs (``RunSizes.graphed``) keep each layer's weight gradients in their own pool, beside
    the ones the optimiser reads: one more copy of the decoder layers' weights in ``model.dtype``."""
    if not run.graphed:
        return 0
    s = run.shape
    per_layer = sum(i * o for i, o in s.linear_shapes().values()) + 2 * s.hidden
    return s.layers * per_layer * run.dtype_bytes


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Keys and values of one cached position over every layer: ``2 x layers x kv_heads x head_dim x b``."""
    return 2 * shape.layers * shape.kv_width * dtype_bytes


def kv_pool_bytes(shape: ModelShape, slots: int, tokens_per_slot: int, dtype_bytes: int) -> int:
    return slots * tokens_per_slot * kv_bytes_per_token(shape, dtype_bytes)


def decode_bytes(shape: ModelShape, slots: int) -> int:
    return slots * shape.vocab * 4 * DECODE_LOGIT_COPIES


def logit_bytes_per_position(shape: ModelShape, dtype_bytes: int) -> int:
    """The output head at one position: logits and their gradient in the model's dtype, float32 temporaries."""
    return shape.vocab * (2 * dtype_bytes + 4 * LOGIT_FLOAT32_COPIES)


def layer_elements(run: RunSizes) -> int:
    """Elements one decoder layer keeps per token in training: ``layer_activations``, and in float32 each head's
    row of attention scores over the longest row (no flash kernel takes float32, and PyTorch's memory-efficient
    one does not take grouped K/V, so attention falls back to the math kernel, which keeps its softmax)."""
    scores = run.shape.heads * run.max_total_tokens if run.dtype_bytes == 4 else 0
    return run.shape.layer_activations(lean_mlp=run.flat) + scores


def activation_bytes_per_token(run: RunSizes) -> int:
    """What a learner micro-batch holds per token between its forward and backward passes (module docstring)."""
    s = run.shape
    layer = layer_elements(run)
    kept = s.layers * s.hidden + layer if run.gradient_checkpointing else s.layers * layer
    if run.reference:  # the reference's forward pass runs while the policy's activations are held
        kept += layer
    if run.graphed:  # each layer's graph keeps a static input, output and output gradient of its own
        kept += 3 * s.layers * s.hidden
    per_token = (kept + 3 * s.hidden) * run.dtype_bytes
    if run.logprob_chunk_tokens <= 0:  # full logits: the head's cost grows with the micro-batch
        per_token += logit_bytes_per_position(s, run.dtype_bytes)
    return per_token


def learner_peak_tokens(run: RunSizes, tokens: int) -> int:
    """The most tokens a micro-batch under a budget of ``tokens`` holds: at most ``micro_batch_size`` rows (not on
    the flat forward pass, whose memory follows its tokens alone), and a row longer than the budget is a
    micro-batch of its own (``ctxrl.learner.batch.pack``)."""
    rows_hold = tokens if run.flat else run.micro_batch_size * run.max_total_tokens
    return max(min(tokens, rows_hold), run.max_total_tokens)


def learner_bytes(run: RunSizes, tokens: int) -> int:
    chunk = logit_bytes_per_position(run.shape, run.dtype_bytes) * run.logprob_chunk_tokens
    return learner_peak_tokens(run, tokens) * activation_bytes_per_token(run) + max(chunk, 0)


def prefill_tokens(run: RunSizes, room: int) -> int:
    """The fast engine's prefill chunk: as many tokens as one layer's activations fit in ``room`` (the learner's,
    unused while the engine runs), at most ``PREFILL_TOKENS``, at least one longest row (a longer prompt is
    prefilled alone anyway)."""
    per_token = layer_elements(run) * run.dtype_bytes
    return max(min(PREFILL_TOKENS, room // per_token), min(run.max_total_tokens, PREFILL_TOKENS))


def activation_budget(run: RunSizes) -> int:
    """Bytes an uncapped plan lets a micro-batch's activations take: ``DEFAULT_ACTIVATION_BYTES``, or
    ``ACTIVATION_SHARE`` of the card's share, whichever is larger (no card: the former)."""
    return max(DEFAULT_ACTIVATION_BYTES, int(ACTIVATION_SHARE * run.card_share * run.device_bytes))


def fitting_tokens(run: RunSizes) -> int:
    """The most tokens (in multiples of 256) whose activations stay within ``activation_budget``."""
    return activation_budget(run) // activation_bytes_per_token(run) // 256 * 256


def auto_slots(run: RunSizes, per_slot: int) -> int:
    """KV slots of an uncapped plan: ``kv_slots`` as asked (``rollout.max_batch_size`` > 0), or every request in
    flight, at most ``MAX_AUTO_SLOTS`` and what ``KV_SHARE`` of the card's share holds, never below
    ``MIN_KV_SLOTS`` (nor above the requests in flight)."""
    if not run.auto_slots or not run.kv_slots:
        return run.kv_slots
    fit = int(KV_SHARE * run.card_share * run.device_bytes) // max(per_slot, 1)
    return min(run.kv_slots, max(MIN_KV_SLOTS, min(MAX_AUTO_SLOTS, fit)))


def default_learner_tokens(run: RunSizes) -> int:
    """Tokens per micro-batch without a cap or a user's value: ``DEFAULT_LEARNER_TOKENS`` (``GRAPHED_LEARNER_TOKENS``
    through CUDA-graphed layers), fewer where their activations would pass ``DEFAULT_ACTIVATION_BYTES``
    (``fitting_tokens``), never fewer than one longest row and never more than a micro-batch holds."""
    wanted = GRAPHED_LEARNER_TOKENS if run.graphed else DEFAULT_LEARNER_TOKENS
    return learner_peak_tokens(run, min(wanted, fitting_tokens(run)))


def allocator_cap(fraction: float, device_bytes: int) -> int:
    """Bytes torch's allocator may hold for a run given ``fraction`` of the card: the share less the CUDA context
    (which lives outside the allocator). ``torch.cuda.set_per_process_memory_fraction`` takes it over
    ``device_bytes``."""
    return int(fraction * device_bytes) - CUDA_CONTEXT_BYTES


# -- the plan -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Least:
    """The smallest run that is still useful: one micro-batch of the longest row (or of the user's token
    budget) and ``MIN_KV_SLOTS`` slots, besides the fixed parts."""

    fixed: int
    per_slot: int
    slots: int
    tokens: int
    learner: int

    @property
    def total(self) -> int:
        return self.fixed + self.slots * self.per_slot + self.learner


def _least(run: RunSizes) -> _Least:
    tokens = run.max_tokens_per_microbatch if run.max_tokens_per_microbatch > 0 else run.max_total_tokens
    per_slot = run.kv_tokens_per_slot * kv_bytes_per_token(run.shape, run.dtype_bytes) + decode_bytes(run.shape, 1)
    return _Least(fixed=weights_bytes(run) + optimizer_bytes(run) + RUNTIME_BYTES, per_slot=per_slot,
                  slots=min(run.kv_slots, MIN_KV_SLOTS), tokens=tokens, learner=learner_bytes(run, tokens))


def plan_memory(run: RunSizes) -> MemoryPlan:
    """The plan for ``run`` (module docstring); a ``ConfigError`` when it cannot fit its budget."""
    least = _least(run)
    explicit = run.max_tokens_per_microbatch > 0
    if run.gpu_memory_fraction <= 0:  # no cap: what the run needs
        slots = auto_slots(run, least.per_slot)
        tokens = least.tokens if explicit else default_learner_tokens(run)
        used = least.fixed + slots * least.per_slot + learner_bytes(run, tokens)
        budget = math.ceil(used / (1 - HEADROOM))
        headroom = budget - used
    else:  # fill the cap: the smallest useful run, then the KV pool's slots, then the learner's tokens
        budget = allocator_cap(run.gpu_memory_fraction, run.device_bytes)
        usable = int(budget * (1 - CAPPED_HEADROOM))
        headroom = budget - usable
        if least.total > usable:
            raise ConfigError(_does_not_fit(run, budget, least))
        room = usable - least.fixed - least.learner
        wanted = min(run.kv_slots, MAX_AUTO_SLOTS) if run.auto_slots else run.kv_slots
        slots = min(wanted, room // least.per_slot)
        room -= slots * least.per_slot
        tokens = least.tokens
        if not explicit:  # (in multiples of 64, or of a graph bucket's step, at most what a micro-batch can hold)
            step = GRAPH_TOKEN_STEP if run.graphed else 64
            grown = (least.tokens + room // activation_bytes_per_token(run)) // step * step
            tokens = learner_peak_tokens(run, max(least.tokens, grown))
    learner = learner_bytes(run, tokens)
    activations = learner - logit_bytes_per_position(run.shape, run.dtype_bytes) * max(run.logprob_chunk_tokens, 0)
    return MemoryPlan(budget_bytes=budget, capped=run.gpu_memory_fraction > 0, weights_bytes=weights_bytes(run),
                      optimizer_bytes=optimizer_bytes(run), kv_slots=slots, kv_tokens_per_slot=run.kv_tokens_per_slot,
                      kv_bytes=kv_pool_bytes(run.shape, slots, run.kv_tokens_per_slot, run.dtype_bytes),
                      decode_bytes=decode_bytes(run.shape, slots), learner_tokens=tokens, learner_bytes=learner,
                      activation_bytes_per_token=activation_bytes_per_token(run),
                      prefill_tokens=prefill_tokens(run, activations) if slots else 0,
                      headroom_bytes=headroom, device_bytes=run.device_bytes,
                      gpu_memory_fraction=run.gpu_memory_fraction)


def smallest_fraction(run: RunSizes) -> float:
    """The smallest ``model.gpu_memory_fraction`` that fits ``run``'s smallest useful plan, rounded up to a hundredth
    (above 1: no share of this card does)."""
    need = _least(run).total / (1 - CAPPED_HEADROOM) + CUDA_CONTEXT_BYTES
    return math.ceil(100 * need / run.device_bytes) / 100 if run.device_bytes else math.inf


def _does_not_fit(run: RunSizes, budget: int, least: _Least) -> str:
    what = (f"train.max_tokens_per_microbatch={run.max_tokens_per_microbatch}" if run.max_tokens_per_microbatch > 0
            else f"one row of rollout.max_total_tokens={run.max_total_tokens}")
    fraction = smallest_fraction(run)
    hint = f"model.gpu_memory_fraction >= {fraction:.2f} would fit it" if fraction <= 1 else "no share of it fits"
    engine = (f" + the smallest KV pool ({least.slots} slots of {run.kv_tokens_per_slot} tokens) "
              f"{gib(least.slots * least.per_slot)} GiB" if least.slots else "")
    return (f"the run does not fit model.gpu_memory_fraction={run.gpu_memory_fraction:g} of this "
            f"{gib(run.device_bytes)} GiB card ({gib(budget)} GiB for torch after the CUDA context, "
            f"{gib(budget * (1 - CAPPED_HEADROOM))} GiB after {CAPPED_HEADROOM:.0%} headroom): weights "
            f"{gib(weights_bytes(run))} GiB + optimiser {gib(optimizer_bytes(run))} GiB + workspaces "
            f"{gib(RUNTIME_BYTES)} GiB{engine} + a micro-batch of "
            f"{least.tokens} tokens ({what}) {gib(least.learner)} GiB = {gib(least.total)} GiB; {hint}. "
            f"To fit: {SETTINGS_TO_CHANGE}")


def check_free(plan: MemoryPlan, free_bytes: int) -> None:
    """A ``ConfigError`` when the card has less free memory now than the plan will hold."""
    if plan.budget_bytes <= free_bytes:
        return
    what = "the model.gpu_memory_fraction cap" if plan.capped else "this run's plan"
    raise ConfigError(f"{what} needs {gib(plan.budget_bytes)} GiB but the card has {gib(free_bytes)} GiB free now "
                      f"(other processes hold the rest): {plan.summary()}. To fit: {SETTINGS_TO_CHANGE}, or free "
                      "the card")

