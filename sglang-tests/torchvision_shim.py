"""Loaded at interpreter start by ``kvlifetime_sglang_torchvision.pth`` in the SGLang venv.

SGLang 0.5.23 imports torchvision through ``sglang.srt.configs`` (multimodal configs that the
disaggregation modules import). The only torchvision wheel for SGLang's pin is a CUDA build: its
compiled ops cannot load against torch's CPU build, and then ``torchvision._meta_registrations``
fails at import ("operator torchvision::nms does not exist"). Registering an empty module under
that name lets torchvision's Python code import; its compiled ops stay unavailable
(``torchvision.extension._has_ops()`` is False), and no disaggregation path calls them.
"""

import sys
import types

sys.modules.setdefault(
    "torchvision._meta_registrations",
    types.ModuleType("torchvision._meta_registrations"),
)
