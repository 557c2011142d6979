"""Device answers that a library cached before activation are asked again.

transformers keeps ``is_torch_cuda_available()`` (and its bf16/tf32/accelerator checks) in an
``lru_cache``: asked once before ``%load_ext remotecuda`` or ``activate()`` (importing a model
module may ask), it says False for the rest of the process, and ``pipeline(..., device=0)`` then
runs on the CPU without a word. Activation and deactivation clear those caches, so the next call
sees the devices there are now.
"""
from __future__ import annotations

import sys

#: module → its cached functions whose answer depends on the CUDA devices
_CACHED = {
    "transformers.utils.import_utils": (
        "is_torch_cuda_available", "is_torch_accelerator_available", "is_torch_bf16_gpu_available",
        "is_torch_bf16_available_on_device", "is_torch_fp16_available_on_device", "is_torch_tf32_available",
    ),
}


def clear() -> None:
    """Forget the cached answers of the modules imported so far (one imported later asks anew)."""
    for module, names in _CACHED.items():
        found = sys.modules.get(module)
        for name in names:
            forget = getattr(getattr(found, name, None), "cache_clear", None)
            if forget is not None:
                forget()
