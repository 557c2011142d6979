"""Karpathy's "Neural Networks: Zero to Hero" code and lucidrains-style code written by hand,
round 7, shrunk (tiny sizes, few steps, seeded, synthetic data) and run unchanged with plain
``python`` (the local CPU) and under ``remotecuda run`` on a CPU gateway; the JSON each prints
last must agree value by value (tests/test_corpus.py's rules). A CPU-served 'cuda' generator
draws what the CPU's draws, so the programs sample from device ``torch.Generator``s and the
global seed as the lectures do, and their samples are compared token by token. The programs
live in tests/corpus:

- makemore_series: the makemore lectures (bigram counts by ``N[ix1, ix2] += 1`` and sampling by
  ``torch.multinomial(..., generator=g)``, the one-hot net trained through ``W.data``, the MLP
  with ``C[X]`` and a hand-made batch norm whose running stats are updated under no_grad,
  "backprop ninja"'s manual gradients of every ``retain_grad()`` intermediate compared with
  autograd's, and the WaveNet of hand-written Linear/BatchNorm1d/FlattenConsecutive classes);
- mingpt_makemore: minGPT (``configure_optimizers``' decay/no_decay sets by module type,
  ``generate`` with ``torch.topk`` and ``logits[:, [-1]]`` masking, the Trainer's infinite
  ``RandomSampler``), makemore.py's RNN/GRU cells and Bag-of-Words block with its
  InfiniteDataLoader and ``@torch.inference_mode()`` evaluate, and the "let's build GPT"
  notebook's ``xbow`` trick, ``get_batch`` and ``@torch.no_grad() estimate_loss``;
- lucidrains_handrolled: einsum attention (``'b h i d, b h j d -> b h i j'``), rotary embeddings
  and xpos by hand, null key/values, qk-norm, talking heads, T5 buckets and ALiBi, token shift
  by a negative ``F.pad``, a chunked attention under ``checkpoint``; then micrograd's torch
  checks (double ``torch.Tensor([...])`` scalars) and its MLP written with torch;
- einops_vit: vit-pytorch with einops itself (``Rearrange`` and ``Reduce`` layers, ``repeat``,
  ``pack``/``unpack`` of a CLS token, ``einops.einsum``, ``parse_shape``), an ``EinMix``
  MLP-Mixer, and MAE's random masking by ``torch.rand(...).argsort`` and batch-range indexing.

Beside them, the fidelity bugs they and their probes found, each shown directly."""
from __future__ import annotations

import os

import pytest
import torch
from test_corpus import F32, assert_program_matches

pytestmark = pytest.mark.usefixtures("remote")

PROGRAMS = [  # (program in tests/corpus, the libraries it needs beyond torch and numpy)
    ("makemore_series", ()),
    ("mingpt_makemore", ()),
    ("lucidrains_handrolled", ()),
    ("einops_vit", ("einops",)),
]


@pytest.mark.parametrize("name,libraries", PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_program_matches_local(gateway, name: str, libraries: tuple[str, ...]):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    for library in libraries:
        pytest.importorskip(library)
    assert_program_matches(gateway, name, F32)


def test_a_generator_set_to_a_saved_state_has_that_states_seed():
    """``g.set_state(saved)`` restores the seed with the state (a CUDA generator's state is its
    seed and offset, a CPU's begins with its seed): ``initial_seed()`` then gives the saved
    generator's seed, as torch's does; it gave the seed the restored generator was made with."""
    def restored(dev: str) -> tuple[int, torch.Tensor]:
        saved = torch.Generator(dev).manual_seed(2147483647)
        torch.randn(4, device=dev, generator=saved)
        g = torch.Generator(dev).manual_seed(1)
        g.set_state(saved.get_state())
        return g.initial_seed(), torch.randn(3, device=dev, generator=g).cpu()
    (seed, drawn), (want_seed, want_drawn) = restored("cuda"), restored("cpu")
    assert seed == want_seed == 2147483647
    torch.testing.assert_close(drawn, want_drawn)


def test_a_generator_state_of_the_wrong_size_is_refused_at_the_call():
    """A GPU's generator checks a new state's size in ``set_state``; the gateway's refusal came at
    a later sync, as the error of whichever op read a value next."""
    g = torch.Generator("cuda").manual_seed(3)
    with pytest.raises(RuntimeError, match="size"):
        g.set_state(torch.zeros(10, dtype=torch.uint8))
    assert g.initial_seed() == 3
    want = torch.randn(2, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(torch.randn(2, device="cuda", generator=g).cpu(), want)


@pytest.mark.parametrize("call", [
    lambda x: torch.histogram(x, bins=10, density=True),
    lambda x: x.histogram(torch.linspace(-2, 2, 5, device="cuda")),
    lambda x: torch.histogramdd(x.view(10, 2), bins=[3, 3]),
], ids=["bins", "edges", "histogramdd"])
def test_an_op_whose_kernel_is_the_cpus_only_is_refused_at_the_call(call):
    """makemore's activation plots, ``hy, hx = torch.histogram(t, density=True)``, moved to 'cuda':
    a GPU's torch has no CUDA kernel for ``histogram`` and raises NotImplementedError at the call;
    a CPU gateway computed it, so the program failed only on a GPU. The CPU copy still works."""
    x = torch.randn(20, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match="with arguments from the 'CUDA' backend"):
        call(x.cuda())
    torch.testing.assert_close(torch.histogram(x.cuda().cpu(), bins=10).hist, torch.histogram(x, bins=10).hist)


def test_the_cpu_only_aten_ops_are_those_native_functions_dispatches_to_the_cpu_alone():
    """Each op in ``CPU_ONLY_ATEN`` has a CPU kernel and no CUDA or composite one in this torch's
    native_functions.yaml (so a new torch that adds a CUDA kernel fails here, not silently)."""
    yaml = pytest.importorskip("yaml")
    torchgen = pytest.importorskip("torchgen")
    from remotecuda.dispatch import CPU_ONLY_ATEN
    path = os.path.join(torchgen.__path__[0], "packaged", "ATen", "native", "native_functions.yaml")
    if not os.path.exists(path):
        pytest.skip("this torch ships no native_functions.yaml")
    with open(path) as f:
        entries = yaml.safe_load(f)
    kernels = {e["func"].split("(")[0]: {k.strip() for spec in e.get("dispatch", {}) for k in spec.split(",")}
               for e in entries}
    for op in CPU_ONLY_ATEN:
        name = op.name().removeprefix("aten::")
        assert "CPU" in kernels[name], op
        assert not kernels[name] & {"CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                                    "CompositeExplicitAutogradNonFunctional"}, op


@pytest.mark.parametrize("call", [
    lambda a: a @ a.T,
    lambda a: torch.bmm(a[None], a.T[None]),
    lambda a: a @ a[0],
    lambda a: torch.dot(a[0], a[1]),
    lambda a: torch.einsum("ij,kj->ik", a, a),
    lambda a: torch.nn.functional.linear(a.int(), a.int()),
    lambda a: a.bool() @ a.bool().T,
], ids=["mm", "bmm", "mv", "dot", "einsum", "linear_int32", "mm_bool"])
def test_an_integer_matrix_product_is_refused_at_the_call_as_cuda_refuses_it(call):
    """The bigram lecture's one-hot encodings are int64 (``F.one_hot(xs)``); multiplied as they
    are, a GPU refuses them at the call (CUDA's matrix products take floating and complex dtypes
    only: '"addmm_cuda" not implemented for 'Long''), where the CPU computes them: a CPU gateway
    did, so the program failed only on a GPU. A float product still runs."""
    a = torch.arange(6, device="cuda").view(2, 3)
    with pytest.raises(RuntimeError, match="not implemented for '(Long|Int|Bool)'"):
        call(a)
    torch.testing.assert_close((a.float() @ a.float().T).cpu(), torch.tensor([[5.0, 14.0], [14.0, 50.0]]))
