"""The SPMD process shells of a PPO/GRPO job: one `Worker` class per process role.

`rl_workers.py` holds the workers (what runs in each process of a worker
group, and which role objects from `hybridflow.roles` it hosts), the typed
group views the trainer calls them through, and `specs.py` the parts of the
config each worker is handed.
"""
