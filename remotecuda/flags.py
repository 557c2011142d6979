"""Backend flags a script sets (cuDNN, TF32, matmul precision, deterministic algorithms and the
``CUBLAS_WORKSPACE_CONFIG`` they need, ``torch.set_default_dtype``, the attention backends) reach the
gateways, where the work they govern runs.

Every Python-level way of setting them (``torch.backends.cudnn.benchmark = True``,
``cudnn.flags(...)``, ``torch.backends.cuda.matmul.allow_tf32``,
``torch.set_float32_matmul_precision``, ``torch.backends.fp32_precision``,
``torch.use_deterministic_algorithms``, ``torch.nn.attention.sdpa_kernel``) ends in
one of a few ``torch._C`` setters; while active those are wrapped to queue an
``rc::set_flags`` op with what changed. It travels with the next batch of ops: no
round trip, and nothing at all when a flag is set to the value the gateway already has.
Sessions opened later get every flag set so far (the runtime's ``flags``).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.backends import ContextProp

from . import runtime


def _deterministic() -> list[bool]:
    return [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()]


#: flag name (as the gateway's ``rc::set_flags`` knows it) → how to read it here
_READ: dict[str, Callable[[], Any]] = {
    "cudnn.enabled": lambda: torch.backends.cudnn.enabled,
    "cudnn.benchmark": lambda: torch.backends.cudnn.benchmark,
    "cudnn.deterministic": lambda: torch.backends.cudnn.deterministic,
    "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "matmul.allow_fp16_reduced_precision_reduction":
        lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    "matmul.allow_bf16_reduced_precision_reduction":
        lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    "matmul.allow_fp16_accumulation": lambda: torch.backends.cuda.matmul.allow_fp16_accumulation,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "deterministic_algorithms": _deterministic,
    # whether deterministic algorithms fill new tensors' memory (NaN, an integer's largest value)
    "fill_uninitialized_memory": torch._C._get_deterministic_fill_uninitialized_memory,
    # an environment variable torch reads at the first cuBLAS call, where the GPU is: the program's,
    # as it is when a flag is set (a program sets it before ``use_deterministic_algorithms``)
    "cublas_workspace_config": lambda: os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    # what a factory given no dtype makes, and what integer tensors promote to (``arange(4) / 3``)
    "default_dtype": lambda: str(torch.get_default_dtype()).removeprefix("torch."),
}
#: torch's newer TF32 API (``torch.backends.fp32_precision = "tf32"``, as transformers' ``tf32=True``
#: sets it; ``torch.backends.cuda.matmul.fp32_precision``, ``cudnn.conv``...): one value per
#: (backend, op), parents first (setting one sets its children; each child is then told its own)
FP32_PRECISION = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"))


def _fp32_precision(backend: str, op: str) -> Callable[[], str]:
    return lambda: torch._C._get_fp32_precision_getter(backend, op)


_READ.update({f"fp32_precision.{b}.{o}": _fp32_precision(b, o) for b, o in FP32_PRECISION})

#: scaled_dot_product_attention's backends the device may pick (``torch.nn.attention.sdpa_kernel``,
#: ``torch.backends.cuda.enable_flash_sdp``...), in what order, and whether its math path may reduce
#: in half precision: the gateway picks the backend (attention.py), so it must know them (torch._C's
#: getter and setter names, those this torch has)
_SDP = {key: name for key, name in {
    "sdp.flash": "flash_sdp_enabled", "sdp.mem_efficient": "mem_efficient_sdp_enabled", "sdp.math": "math_sdp_enabled",
    "sdp.cudnn": "cudnn_sdp_enabled", "sdp.overrideable": "overrideable_sdp_enabled",
    "sdp.priority_order": "sdp_priority_order", "sdp.math_fp16_bf16_reduction": "math_sdp_allow_fp16_bf16_reduction",
}.items() if hasattr(torch._C, f"_get_{name}")}
_READ.update({key: getattr(torch._C, f"_get_{name}") for key, name in _SDP.items()})

#: a fresh process's values: what a gateway's worker starts with
DEFAULTS: dict[str, Any] = {
    "cudnn.enabled": True, "cudnn.benchmark": False, "cudnn.deterministic": False, "cudnn.allow_tf32": True,
    "matmul.allow_tf32": False, "matmul.allow_fp16_reduced_precision_reduction": True,
    "matmul.allow_bf16_reduced_precision_reduction": True, "matmul.allow_fp16_accumulation": False,
    "float32_matmul_precision": "highest", "deterministic_algorithms": [False, False],
    "fill_uninitialized_memory": True, "cublas_workspace_config": None, "default_dtype": "float32",
    "preferred_linalg_library": "Default", "preferred_blas_library": "Cublas",
    "fp32_precision.generic.all": "none", "fp32_precision.cuda.all": "none", "fp32_precision.cuda.matmul": "none",
    "fp32_precision.cuda.conv": "tf32", "fp32_precision.cuda.rnn": "tf32",
    "sdp.flash": True, "sdp.mem_efficient": True, "sdp.math": True, "sdp.cudnn": True, "sdp.overrideable": True,
    "sdp.priority_order": [1, 2, 0, 3, 4], "sdp.math_fp16_bf16_reduction": False,
}

#: the torch._C setters every route above ends in
_SETTERS = ("_set_cudnn_enabled", "_set_cudnn_benchmark", "_set_cudnn_deterministic", "_set_cudnn_allow_tf32",
            "_set_cublas_allow_tf32", "_set_cublas_allow_fp16_reduced_precision_reduction",
            "_set_cublas_allow_bf16_reduced_precision_reduction", "_set_cublas_allow_fp16_accumulation",
            "_set_float32_matmul_precision", "_set_deterministic_algorithms",
            "_set_deterministic_fill_uninitialized_memory", "_set_default_dtype", "_set_fp32_precision_setter",
            *(name for name in ("_set_sdp_use_flash", "_set_sdp_use_mem_efficient", "_set_sdp_use_math",
                                "_set_sdp_use_cudnn", "_set_sdp_use_overrideable", "_set_sdp_priority_order",
                                "_set_math_sdp_allow_fp16_bf16_reduction") if hasattr(torch._C, name)))
#: CUDA library choices a CPU-only torch refuses to hold, having neither library
#: (``torch.backends.cuda.preferred_linalg_library("cusolver")``, ``preferred_blas_library("cublaslt")``
#: raised "not compiled with cuSOLVER" in the program): while active the client keeps them (the
#: runtime's ``flags``, by the enum's member name) and the gateway's torch applies them. flag → torch._C's
#: getter, setter and enum
_HELD = {
    "preferred_linalg_library": ("_get_linalg_preferred_backend", "_set_linalg_preferred_backend", "_LinalgBackend"),
    "preferred_blas_library": ("_get_blas_preferred_backend", "_set_blas_preferred_backend", "_BlasBackend"),
}
#: cudnn's properties hold their setter, not torch._C's attribute: re-pointed while active
_CUDNN_PROPS = {"enabled": "_set_cudnn_enabled", "benchmark": "_set_cudnn_benchmark",
                "deterministic": "_set_cudnn_deterministic", "allow_tf32": "_set_cudnn_allow_tf32"}


def sdp_backends() -> tuple:
    """The attention settings as they are now (part of a backend choice's key: attention.py)."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in (_READ[key]() for key in _SDP))


def _current() -> dict[str, Any]:
    values = {}
    for key, read in _READ.items():
        try:
            value = read()
        except RuntimeError:  # e.g. torch refuses to read a legacy TF32 flag once fp32_precision was used
            continue
        values[key] = list(value) if isinstance(value, tuple) else value
    return values


def changed() -> None:
    """Queue what differs from what the gateways were told (the defaults, then each change)."""
    rt = runtime.active()
    if rt is not None:
        _tell(rt, {k: v for k, v in _current().items() if rt.flags.get(k, DEFAULTS[k]) != v})


def _tell(rt: Any, delta: dict[str, Any]) -> None:
    if not delta:
        return
    rt.flags.update(delta)
    if "default_dtype" in delta:
        rt.dispatcher.default_dtype_set(torch.get_default_dtype())
    for s in list(rt.pool.sessions.values()):
        if not s.closed:
            s.enqueue("rc::set_flags", [delta], None, None)


def _noting(setter: Callable) -> Callable:
    def set_flag(*args: Any, **kwargs: Any) -> Any:
        out = setter(*args, **kwargs)
        changed()
        return out
    return set_flag


def _held_getter(key: str, enum: Any) -> Callable[[], Any]:
    return lambda: getattr(enum, runtime.current().flags.get(key, DEFAULTS[key]))


def _held_setter(key: str) -> Callable[[Any], None]:
    def set_flag(backend: Any) -> None:
        rt = runtime.current()
        _tell(rt, {key: backend.name} if rt.flags.get(key, DEFAULTS[key]) != backend.name else {})
    return set_flag


def _late_bound(name: str) -> Callable[[Any], Any]:
    return lambda value: getattr(torch._C, name)(value)


def install(p: Any) -> None:
    """Wrap the setters (through ``p``, the interception's patch record); tell the gateways
    about flags set before activation."""
    for name in _SETTERS:
        p.set(torch._C, name, _noting(getattr(torch._C, name)))
    for key, (getter, setter, enum) in _HELD.items():
        p.set(torch._C, getter, _held_getter(key, getattr(torch._C, enum)))
        p.set(torch._C, setter, _held_setter(key))
    cudnn_type = type(torch.backends.cudnn)
    for prop, name in _CUDNN_PROPS.items():
        p.set(cudnn_type, prop, ContextProp(vars(cudnn_type)[prop].getter, _late_bound(name)))
    changed()
