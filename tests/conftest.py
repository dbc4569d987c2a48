"""Suite-wide settings: GPU tests are skipped where no CUDA device exists; one Ray cluster per session."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for the whole test session: `ray.init` costs 5-10 s on these machines."""
    import ray

    from hybridflow.controller import init_ray

    init_ray(num_cpus=8)
    yield ray
    ray.shutdown()
