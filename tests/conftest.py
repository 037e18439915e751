import pytest
import torch


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield
