import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2_path():
    from pagefleet.worker.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from engine_models import TINY_ARCHS, tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: tiny_model(arch, root / arch) for arch in TINY_ARCHS}
