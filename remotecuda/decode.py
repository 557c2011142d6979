"""Decoding at gateway speed: ``generate()`` and ``server_decode``, at most one round trip a call.

A decode loop streams its ops like any other code; what makes it wait on the network is the
values it reads. Hugging Face's ``generate()`` reads several before the first token (is the pad
token an EOS token, is the mask all ones, is there right padding), one per token to build the
attention mask (``fast_all(padding_mask)``), one per token for the SDPA backend of each new key
length, and one per token to decide whether to stop (``unfinished_sequences.max() == 0``).
While remotecuda is active, ``GenerationMixin.generate`` of a model (a decoder-only or an
encoder-decoder one: its decoder's loop) decoding greedily, by sampling or by beam search (no
assistant, no streamer) runs in ``decoding``, where:

* the reads on its inputs are answered by the client (known.py: the ids and the mask it
  uploaded, and what follows from them; integer inputs made on the device are read once, together,
  at the start);
* attention is one ``rc::sdpa`` op, the gateway's own backend choice, with nothing asked;
* the stop check is ``transformers``' own deferral hook (``DeferredStopCheck``, which it uses
  on MPS): the loop waits for nothing (``Progress``), and the steps taken after the one where
  eager decoding stopped are undone (the tokens trimmed) as transformers does. A call that
  returns its cache (``return_dict_in_generate``) keeps transformers' check, one read a step:
  no step may be undone in a cache the caller gets; beam search keeps its own, also one a step.

So the tokens are eager's, and a greedy or sampled call costs at most one blocking round trip. When every row
has met EOS early, the client learns it a few steps late, without waiting (``Progress``): the
gateway decodes those steps, which are undone, its generator included.
Anything else (an assistant, a streamer, a user-given cache, logits processors, stopping criteria,
forward hooks or a ``prefix_allowed_tokens_fn`` of the user's own: code that sees every step, and
may keep what it saw; a ``max_time``) takes the plain path, as before.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import downloads, known, runtime
from .tensor import RemoteTensor

#: the module whose ``GenerationMixin`` and stop checks are patched
GENERATION = "transformers.generation.utils"
_ids = itertools.count(1)  # Progress ids (the gateway's generator marks), never reused


@contextmanager
def decoding(rt: Any) -> Iterator[None]:
    """Value reads on known inputs answered locally, attention without a backend question."""
    before = rt.decoding, rt.dispatcher.propagate
    rt.decoding = rt.dispatcher.propagate = True
    try:
        yield
    finally:
        rt.decoding, rt.dispatcher.propagate = before


def install(patches: Any) -> None:
    """Route ``generate()`` of Hugging Face models here while active (when transformers is
    imported, now or later)."""
    downloads.on_import(patches, GENERATION, _patch)


def _patch(patches: Any, module: Any) -> None:
    mixin = getattr(module, "GenerationMixin", None)
    deferred = getattr(module, "DeferredStopCheck", None)
    if mixin is None or deferred is None or not hasattr(module, "StopCheck"):
        return  # (a transformers without the stop-check hook: generate stays as it is)
    patches.set(mixin, "generate", _generate(mixin.generate))
    patches.set(module, "DeferredStopCheck", _stop_check(module.StopCheck, deferred))


def _generate(original: Any) -> Any:
    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        rt = runtime.active()
        if rt is None or rt.decoding or not _supported(self, kwargs):
            return original(self, *args, **kwargs)
        _learn_inputs([*args, *kwargs.values()])
        with decoding(rt):
            return original(self, *args, **kwargs)
    return generate


def _supported(model: Any, kwargs: dict) -> bool:
    """Whether a ``generate`` call is one decoded here: a model on a remote device,
    no assistant, nothing that needs every token on the client, no code of the user's that sees
    every step (the steps undone after eager's last would have been seen too)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    try:
        if model.device.type != "cuda":
            return False
    except (AttributeError, StopIteration):
        return False
    return (all(kwargs.get(k) is None for k in ("streamer", "assistant_model", "prompt_lookup_num_tokens",
                                                "past_key_values", "prefix_allowed_tokens_fn"))
            and all(_own(kwargs.get(k)) for k in ("logits_processor", "stopping_criteria"))
            and _own(_forward_hooks(model))
            and not _timed(model, kwargs))


def _timed(model: Any, kwargs: dict) -> bool:
    """Whether the call is bounded by wall time (``max_time``, or a ``MaxTimeCriteria`` given): its
    clock is read by the client's loop, which runs ahead of the gateway here, so the time would be
    up long before the tokens are, and the call would last until all those it issued were computed
    (18 s for ``max_time=0.9``). On the plain path each step waits for its token, as on a GPU."""
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    if kwargs.get("max_time") is not None or any(getattr(c, "max_time", None) is not None for c in configs):
        return True
    return any(type(c).__name__ == "MaxTimeCriteria" for c in kwargs.get("stopping_criteria") or ())


def _own(steps: Any) -> bool:
    """Whether given logits processors, stopping criteria or forward hooks are all transformers'
    own, as ``generate()`` builds from its arguments (Whisper's ``generate`` passes its
    suppressions so) and as its models install (the hooks that capture attentions): they compute
    on what they are given, so the steps undone after eager's last leave no trace. A class or a
    hook of the user's may keep state or print (a hook collecting each step's activations), and
    sees every step on the plain path."""
    return steps is None or all(_code_module(s).startswith("transformers.") for s in steps)


def _code_module(obj: Any) -> str:
    """The module that defines a callable: a function's, a ``functools.partial``'s function's, an
    instance's class's."""
    return getattr(getattr(obj, "func", obj), "__module__", None) or type(obj).__module__


def _forward_hooks(model: torch.nn.Module) -> list:
    """Every forward hook and pre-hook that a forward of the model runs: its modules' and the
    global ones (``register_module_forward_hook``)."""
    from torch.nn.modules import module as nn_module
    hooks = [*nn_module._global_forward_hooks.values(), *nn_module._global_forward_pre_hooks.values()]
    for m in model.modules():
        hooks += [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
    return hooks


def _learn_inputs(values: list) -> None:
    """Make the call's integer tensors known (known.py), all read in one round trip: ids or a
    mask computed on the device (``(ids != pad).long()``, ``torch.ones_like(ids)``, the ids a
    previous ``generate()`` returned) would otherwise cost a value read at every step."""
    unknown = [v for v in values if isinstance(v, RemoteTensor) and not v.dtype.is_floating_point
               and not v.dtype.is_complex and v.numel() <= known.LIMIT and known.value(v) is None]
    for t, cpu in zip(unknown, downloads.fetch(unknown)):
        known.remember(t, cpu)


def _stop_check(base: type, deferred: type) -> type:
    """transformers' ``DeferredStopCheck`` while active: on a remote device in ``decoding``, a
    check that never reads (``RemoteStopCheck``); elsewhere transformers' own."""

    class RemoteStopCheck(base):  # type: ignore[valid-type, misc]
        """Waits for nothing per step (``Progress``); the steps taken after eager's last are undone."""

        @staticmethod
        def is_supported(device: torch.device, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
            rt = runtime.active()
            if rt is not None and rt.decoding and device.type == "cuda":
                return not is_assistant and not cache_is_returned
            return deferred.is_supported(device, cache, cache_is_returned, is_assistant)

        def __new__(cls, input_ids: torch.Tensor, max_length: int | None, cache: Any, cache_is_returned: bool,
                    streamer: Any = None) -> Any:
            rt = runtime.active()
            if rt is None or not rt.decoding or input_ids.device.type != "cuda":
                return deferred(input_ids, max_length, cache, cache_is_returned, streamer)
            if streamer is not None or max_length is None:
                return base(streamer)  # (every token needed on the client, or no bound to run to)
            return super().__new__(cls)

        def __init__(self, input_ids: torch.Tensor, max_length: int, cache: Any, cache_is_returned: bool,
                     streamer: Any = None) -> None:
            super().__init__(None)
            self.max_length = max_length
            self.progress = Progress(input_ids.device)

        def __call__(self, unfinished_sequences: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
            return self.progress.step(unfinished_sequences) or length >= self.max_length

        def finish(self) -> int:
            return self.progress.steps - self.progress.taken()

    return RemoteStopCheck


class Progress:
    """Where eager decoding would have stopped, learnt without waiting for it.

    The gateway counts the steps after which some row was still unfinished (``live``); the
    count is asked for with ``Session.request_later`` — one question in flight at a time,
    collected at a later step if its answer has come. A count below the steps asked about
    means every row had finished: the loop stops (a few steps late, which are undone). At the
    end, the one blocking read of a call is this count, unless an answer already gave it. The
    gateway keeps its default generator's state after each step (``rc::rng_mark``) and is put
    back to eager's last (``rc::rng_rewind``): the undone steps' draws leave no trace, so what a
    program samples after the call is what it samples after eager's.
    """

    def __init__(self, device: torch.device) -> None:
        self.steps = 0
        self.live = torch.zeros((), dtype=torch.long, device=device)
        self.id = next(_ids)
        self.asked: tuple[int, int] | None = None  # (request id, the steps it asks about)
        self.known: int | None = None  # live, once an answer showed that every row had finished

    def step(self, unfinished: torch.Tensor) -> bool:
        """Count one step (``unfinished``: the rows still going after it); whether eager has stopped."""
        self.steps += 1
        self.live = self.live + (unfinished.max() != 0)
        if self.live.device.type != "cuda":
            return False
        s = self.live._s
        s.enqueue("rc::rng_mark", [self.id, self.steps], None, None)
        if self.asked is not None:
            came, value = s.answer(self.asked[0])
            if not came:
                return False
            asked_steps, self.asked = self.asked[1], None
            if value is not None and value < asked_steps:
                self.known = int(value)
                return True
        rid = s.request_later("aten::_local_scalar_dense.default", [self.live._w])
        self.asked = None if rid is None else (rid, self.steps)
        return False

    def taken(self) -> int:
        """How many of the steps eager decoding takes: through the first after which no row was
        unfinished (all of them if there was none)."""
        if self.asked is not None:
            self.live._s.forget(self.asked[0])
            self.asked = None
        live = self.known if self.known is not None else int(self.live)
        taken = min(live + 1, self.steps)
        if self.live.device.type == "cuda" and self.steps:
            self.live._s.enqueue("rc::rng_rewind", [self.id, taken if taken < self.steps else None], None, None)
        return taken


def server_decode(model: Any, input_ids: torch.Tensor, max_new_tokens: int, *,
                  attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                  pad_token_id: int | None = None) -> torch.Tensor:
    """Decode ``max_new_tokens`` tokens after ``input_ids`` with one blocking round trip.

    A Hugging Face model goes to its ``generate()`` (above). Any other ``model(ids)`` that returns
    logits (or an output with ``.logits``) of shape (batch, length, vocab) is run by the same
    loop here, with no cache (the whole sequence each step): greedy, or sampling with
    ``temperature``, ``top_k`` and ``top_p`` as transformers' processors do; rows that met
    ``eos_token_id`` continue with ``pad_token_id``; the result is trimmed where every row had
    finished. Runs unchanged, as the reference, on local tensors.
    """
    if hasattr(model, "generate") and hasattr(model, "generation_config"):
        kw: dict = {"do_sample": do_sample}
        if do_sample:
            kw.update(temperature=temperature, top_k=top_k, top_p=top_p)
        if eos_token_id is not None:
            kw["eos_token_id"] = eos_token_id
        if pad_token_id is not None:
            kw["pad_token_id"] = pad_token_id
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **kw)
    rt = runtime.active()
    if rt is None or input_ids.device.type != "cuda":
        return _loop(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id)
    with decoding(rt):
        return _loop(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id)


def _loop(model: Any, ids: torch.Tensor, n: int, do_sample: bool, temperature: float, top_k: int | None,
          top_p: float | None, eos: int | list[int] | None, pad: int | None) -> torch.Tensor:
    start = ids.shape[1]
    eos_t = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=ids.device)
    unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
    progress = Progress(ids.device)
    with torch.no_grad():
        for _ in range(n):
            out = model(ids)
            scores = getattr(out, "logits", out)[:, -1].float()
            if do_sample:
                tokens = torch.multinomial(torch.softmax(_filtered(scores, temperature, top_k, top_p), dim=-1),
                                           num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)
            if eos_t is not None:
                tokens = tokens * unfinished + (pad if pad is not None else 0) * (1 - unfinished)
                unfinished = unfinished & ~torch.isin(tokens, eos_t)
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            if eos_t is not None and progress.step(unfinished):
                break
    if eos_t is None or n == 0:
        return ids
    return ids[:, :start + progress.taken()]


def _filtered(scores: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Scores as transformers' temperature, top-k and top-p processors leave them."""
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k > 0:
        k = min(top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = 0
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores
