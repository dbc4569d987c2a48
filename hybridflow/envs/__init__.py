"""Tools and environments for multi-turn rollouts, as plain Python: a `Tool` answers a call with text, an
`Environment` answers a model's turn with an observation, a reward and whether the episode is done."""
