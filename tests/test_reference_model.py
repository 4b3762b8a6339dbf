"""build_reference_model's entry points: ops= (an AttentionOps object, no
plugin manager involved) and vendor= (the vendor's ops, a convenience)."""

from __future__ import annotations

import sys

import hangs
import pytest

from graphmode import ConfigError
from graphmode.attention import ReferenceAttentionOps
from graphmode.model import ModelConfig, build_reference_model
from graphmode_ascend.ops import AscendAttentionOps


def test_ops_are_used_as_given_without_loading_any_plugin():
    script = (
        "import sys\n"
        "from graphmode.attention import ReferenceAttentionOps\nfrom graphmode.model import ModelConfig, build_reference_model\n"
        "ops = ReferenceAttentionOps()\n"
        "model = build_reference_model(ModelConfig.tiny(), ops=ops)\n"
        "assert all(layer.self_attn.ops is ops for layer in model.layers)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('graphmode.plugins', 'graphmode_'))))\n"
    )
    result = hangs.run([sys.executable, "-c", script], ci_seconds=5, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_vendor_path_takes_the_vendors_ops():
    model = build_reference_model(ModelConfig.tiny(), "ascend")
    assert all(isinstance(layer.self_attn.ops, AscendAttentionOps) for layer in model.layers)


def test_both_ops_and_a_vendor_is_refused():
    with pytest.raises(ConfigError, match=r"^build_reference_model got both vendor='ascend' and ops=.*pass ops= alone"):
        build_reference_model(ModelConfig.tiny(), "ascend", ops=ReferenceAttentionOps())
