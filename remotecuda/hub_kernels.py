"""Hugging Face hub kernels stay off while active.

transformers ``kernelize``s a model loaded onto 'cuda' (``from_pretrained(..., device_map="cuda")``
by default) with compiled CUDA kernels that the ``kernels`` package fetches from the hub and
loads into this process. They are built for a local GPU and a CUDA torch; here there is
neither (offline, fetching fails outright). With ``USE_HUB_KERNELS=NO``, transformers' own
switch, the model keeps its PyTorch layers, whose ops run on the gateway. A value the user set
is left as it is.
"""
from __future__ import annotations

import os
from typing import Any

SWITCH = "USE_HUB_KERNELS"


def install(patches: Any) -> None:
    if SWITCH not in os.environ:
        patches.set_item(os.environ, SWITCH, "NO")
