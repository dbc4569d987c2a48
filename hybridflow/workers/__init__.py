"""The SPMD process shells of a PPO/GRPO job: one `Worker` class per process role.

`rl_workers.py` holds the workers (what runs in each process of a worker
group, and which role objects from `hybridflow.roles` it hosts) and the typed
group views the trainer calls them through; `specs.py` the parts of the
config each worker is handed; `engines.py` the table of engine kinds;
`driver_rows.py` which rows stay off the driver.
"""
