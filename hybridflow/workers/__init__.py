"""One class per role; each is handed its engine (STYLE rule 6).

- `Actor`: old log-probs and the policy update (PPO-family losses by name);
- `Critic`: values and the value update;
- `Reference`: frozen log-probs for KL.

Worker groups (SPMD processes) host these roles; the roles themselves only
see a batch and an engine.
"""
from hybridflow.workers.actor import Actor
from hybridflow.workers.critic import Critic
from hybridflow.workers.reference import Reference

__all__ = ["Actor", "Critic", "Reference"]
