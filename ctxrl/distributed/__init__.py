"""Scale-out: rollout workers on Ray (``pool``), asynchronous training with bounded staleness."""
