"""The learner: what turns scored rows into a gradient step, below the run that assembles it.

``learner`` (``Learner``: the policy loss, its micro-batches and optimiser step), its forward passes (``logprobs``,
``head``; ``flat`` and ``layer_graphs``, the learner's own forward over sequences laid end to end), the rows
(``batch``, ``packing``), mixed precision and gradient accumulation (``precision``, ``grad_accumulate``), the
memory plan (``memory``, ``sizing``), and the modules that run beside the policy: ``policy`` (full fine-tuning or
LoRA, the KL reference), ``critic``, ``teacher``. Nothing here imports ``rollout``, ``meta``, ``envs``, the
config or the run (issue 50); the package's ``__init__`` imports none of its modules.
"""
