"""One Ray cluster for the whole test session: `ray.init` costs 5-10 s on these machines."""
import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from hybridflow.controller import init_ray

    init_ray(num_cpus=8)
    yield ray
    ray.shutdown()
