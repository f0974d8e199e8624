import os
from collections.abc import Iterator

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Files holding slow (end-to-end) tests run first, in collection order otherwise: with
    pytest-xdist's --dist worksteal (make test) the long tests then start early, and the short ones
    at the end balance the two workers (no worker is left alone with a long test at the end)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort: file order kept within each part


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server (its own temporary database) for every test of this pytest process that
    needs one (starting it takes 10-20 s); the Prefect client of this process talks to it."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> str:
    """A warm-start cache for the runs of this pytest process: the tiny model's supervised warm start
    is made once per config, not once per test (an entry is written under a temp name and renamed)."""
    return str(tmp_path_factory.mktemp("warmstart-cache"))


@pytest.fixture(scope="session")
def shared_rewards() -> Iterator[dict[str, str]]:
    """A reward cluster for this pytest process's in-process runs whose subject is not the cluster
    itself: the ``reward.*`` overrides with which a run reaches it as an external TLS scheduler (its
    address and certificate files), as a user's runs reach a standing cluster, instead of starting a
    cluster of its own (three processes, ~4 s of CPU on a 2-core EPYC). It is the cluster a
    ``RewardService`` starts, with the same preloads; runs about a cluster's start, its faults or its
    shutdown, and hostile programs that could harm a worker, start their own."""
    from areal_core.reward.config import RewardConfig
    from areal_core.reward.service import RewardService

    with RewardService(RewardConfig()) as rewards:
        yield {f"reward.{k}": v for k, v in rewards.client_settings().items()}


@pytest.fixture(scope="session")
def shared_grading(shared_rewards):
    """The same cluster as ``shared_rewards``, as the ``RewardConfig`` an evaluation grades with."""
    from areal_core.reward.config import RewardConfig

    return RewardConfig(**{k.removeprefix("reward."): v for k, v in shared_rewards.items()})
