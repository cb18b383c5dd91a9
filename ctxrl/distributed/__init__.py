"""Scale-out: rollout workers on Ray (``pool``), asynchronous training with bounded staleness, and a
data-parallel learner over torch.distributed (``data_parallel``); FSDP2 sharding of the learner's model, its
checkpoints and its per-rank memory plan (``sharded``, ``sharded_checkpoint``, ``sharded_memory``)."""
