"""Learning across episodes (meta-RL): credit across the attempts of a trial, annealed
demonstrations, and trial statistics. Pure functions over plain data; the multi-attempt rollout
loop and the trainer wiring live elsewhere (docs/meta.md)."""
