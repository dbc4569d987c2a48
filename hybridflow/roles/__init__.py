"""What each RL role computes, on an engine or generator it is handed (rule 6, docs/conventions.md).

- `Actor`: old log-probs and the policy update (PPO-family losses by name);
- `Critic`: values and the value update;
- `Reference`: frozen log-probs for KL;
- `Rollout`: this rank's prompts -> the rollout batch, with the built-in generator;
- `scoring`: the rule reward of each response, where the rollout is made;
- `preparation`: the token-level half of preparing a batch (scores on the last token, KL in the
  reward, advantages), run where the rows are.

A role sees only a batch, its config section and its engine: no processes,
no ranks beyond the engine's layout. The process shells that host roles in
worker groups are in `hybridflow.workers`.
"""
from hybridflow.roles.actor import Actor
from hybridflow.roles.critic import Critic
from hybridflow.roles.reference import Reference
from hybridflow.roles.rollout import Rollout

__all__ = ["Actor", "Critic", "Reference", "Rollout"]
