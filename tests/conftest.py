import os

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct GGUF (fetched into the cache on first use)."""
    from jaxinfer.loading.hub import resolve_alias

    return resolve_alias("smollm2-135m")


@pytest.fixture(scope="session")
def data_dir() -> str:
    return os.path.join(os.path.dirname(__file__), "data")
