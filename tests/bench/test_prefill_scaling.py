"""prefill_scaling's choice of SDPA backend (pure: no GPU needed for the CUDA rule)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from workbench.bench.prefill_scaling import _sdpa_backend
from workbench.errors import ConfigError


def test_flash_on_cuda_refuses_fp32_with_a_config_error():
    with pytest.raises(ConfigError, match="fp16/bf16"):
        _sdpa_backend("flash", torch.device("cuda"), torch.float32)
    assert _sdpa_backend("flash", torch.device("cuda"), torch.bfloat16) == SDPBackend.FLASH_ATTENTION
    assert _sdpa_backend("flash", torch.device("cpu"), torch.float32) == SDPBackend.FLASH_ATTENTION
    assert _sdpa_backend("math", torch.device("cuda"), torch.float32) == SDPBackend.MATH
