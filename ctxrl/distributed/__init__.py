"""Scale-out: rollout workers on Ray (``pool``), asynchronous training with bounded staleness, and a
data-parallel learner over torch.distributed (``data_parallel``)."""
