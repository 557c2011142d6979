"""Decoding at gateway speed (remotecuda/decode.py): ``generate()`` of Hugging Face models
and ``remotecuda.server_decode`` give the local CPU's tokens with one blocking round trip per
call — greedy and sampled, a left-padded batch, EOS stopping early — and one read per token
where a stop is checked every step (beam search, a returned cache), inputs made on the device
read once."""
from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

import remotecuda  # noqa: E402

IDS = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # the first row left-padded
SMALL = dict(vocab_size=64, max_position_embeddings=128)


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                          bos_token_id=1, eos_token_id=2)).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _round_trips() -> float:
    return remotecuda.stats()["blocking_round_trips"]


def _both(model: torch.nn.Module, call, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``call(model, ids, mask)`` locally and on the gateway under one seed: (local, remote, the
    remote call's blocking round trips)."""
    torch.manual_seed(seed)
    local = call(model, IDS, MASK)
    remote_model = copy.deepcopy(model).cuda()
    ids, mask = IDS.cuda(), MASK.cuda()
    torch.manual_seed(seed)
    before = _round_trips()
    out = call(remote_model, ids, mask)
    trips = _round_trips() - before
    return local, out.cpu(), trips


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_gives_eager_tokens_in_one_round_trip(remote, arch, sample):
    kw = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8) if sample else dict(do_sample=False)
    local, out, trips = _both(MODELS[arch](), lambda m, x, a: m.generate(
        x, attention_mask=a, max_new_tokens=64, pad_token_id=0, **kw))
    assert out.shape == (2, 6 + 64)
    assert torch.equal(out, local)
    assert trips == 1


def test_eos_stops_as_eager(remote):
    """A row that met EOS is padded, and the output ends where every row had finished, as eager's
    does (the client learns it without waiting, a few steps late: those steps are undone). At most
    one blocking round trip: none when the gateway's answer came during the loop."""
    model = _gpt2()
    torch.manual_seed(0)
    greedy = model.generate(IDS, attention_mask=MASK, max_new_tokens=12, do_sample=False, pad_token_id=0)
    # EOS: the tokens greedy decoding picks at steps 3 and 5, so both rows finish early
    eos = [int(greedy[0, 6 + 2]), int(greedy[1, 6 + 4])]
    local, out, trips = _both(model, lambda m, x, a: m.generate(
        x, attention_mask=a, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos))
    assert local.shape[1] < 6 + 12
    assert torch.equal(out, local)
    assert trips <= 1


def test_inputs_made_on_the_device_are_read_once(remote):
    """A mask computed on 'cuda' (``(ids != pad).long()``) and ids a previous ``generate()``
    returned are not values the client uploaded: they are read once, together, at the start,
    not at every step (the padded mask was read per token)."""
    def call(m: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x * mask  # (the first row left-padded with 0)
        first = m.generate(x, attention_mask=(x != 0).long(), max_new_tokens=3, do_sample=False, pad_token_id=0)
        return m.generate(first, attention_mask=(first != 0).long(), max_new_tokens=16, do_sample=False,
                          pad_token_id=0)
    local, out, trips = _both(_llama(), call)
    assert torch.equal(out, local)
    assert trips <= 4  # (two calls, each: its inputs, then the stop count)


@pytest.mark.parametrize("bound", ["max_time", "generation_config", "criteria"])
def test_a_call_bounded_by_wall_time_waits_for_each_token(remote, bound):
    """``max_time`` is read on the client's clock: decoded ahead of the gateway, the time ran out
    long before the tokens did, and the call lasted until all those issued were computed (27 s for
    ``max_time=1.0``). Such a call takes the plain path, each step waiting for its token as on a
    GPU (a limit not reached here, so the tokens are the local ones)."""
    kw: dict = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    if bound == "max_time":
        kw["max_time"] = 600.0
    elif bound == "generation_config":
        kw["generation_config"] = T.GenerationConfig(max_time=600.0, **kw)
        kw = {"generation_config": kw["generation_config"]}
    else:
        kw["stopping_criteria"] = T.StoppingCriteriaList([T.MaxTimeCriteria(600.0)])
    local, out, trips = _both(_gpt2(), lambda m, x, a: m.generate(x, attention_mask=a, **kw))
    assert torch.equal(out, local)
    assert trips >= 8


def test_returned_dict_reads_only_the_stop_check(remote):
    """``return_dict_in_generate`` with scores and logits returns the cache, so the stop is checked
    every step (no step may be undone in it), but the mask and attention reads are answered as in
    any decode: one read per token, not three."""
    def call(m: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = m.generate(x, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, output_logits=True)
        assert out.past_key_values is not None
        return torch.cat([out.sequences.float(), torch.stack(out.scores, 1).flatten(1),
                          torch.stack(out.logits, 1).flatten(1)], 1)
    local, out, trips = _both(_llama(), call)
    torch.testing.assert_close(out, local, rtol=1e-4, atol=1e-5)
    assert trips <= 16 + 2


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_encoder_decoder_generates_as_eager(remote, sample):
    """T5's decoder loop is decoded too: EOS met early by both rows (steps undone, the generator
    rewound), eager's tokens, no read per token (it read three a token)."""
    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0)).eval()
    greedy = model.generate(IDS, attention_mask=MASK, max_new_tokens=16, do_sample=False)
    eos = [int(greedy[0, 3]), int(greedy[1, 5])]
    kw = dict(do_sample=True, top_k=5) if sample else dict(do_sample=False)
    local, out, trips = _both(model, lambda m, x, a: torch.cat([m.generate(
        x, attention_mask=a, max_new_tokens=16, eos_token_id=eos, **kw), torch.rand(2, 1, device=x.device)], 1))
    assert sample or local.shape[1] < 1 + 16 + 1  # (greedy: the rows stopped early)
    assert torch.equal(out, local)
    assert trips <= 2



class _CountingProcessor(T.LogitsProcessor):
    """A logits processor of the user's own: it may keep state, so it must see eager's steps only."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return scores


def test_whisper_and_given_transformers_processors_decode_without_a_read_per_token(remote):
    """Whisper's ``generate`` hands its suppressions to ``GenerationMixin.generate`` as a
    ``logits_processor``, as users do with ``LogitsProcessorList([MinLengthLogitsProcessor...])``:
    transformers' own classes decode here (a read per token before, the stop check), the rows
    meeting EOS early; a processor class of the user's keeps the plain path and sees eager's steps."""
    torch.manual_seed(0)
    model = T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=100, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=20,
        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
        begin_suppress_tokens=[9], suppress_tokens=[10, 11], tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.proj_out.weight.normal_()
    features = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(3))
    eos = int(model.generate(features, max_new_tokens=16)[0, 8])  # (a token met early)

    def call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        min_length = T.MinLengthLogitsProcessor(4, eos_token_id=eos, device=x.device)
        return m.generate(x, max_new_tokens=16, eos_token_id=eos, logits_processor=T.LogitsProcessorList([min_length]))
    expected = call(model, features)
    remote_model = copy.deepcopy(model).cuda()
    x = features.cuda()
    before = _round_trips()
    got = call(remote_model, x)
    trips = _round_trips() - before
    assert expected.shape[1] < 16 + 1 and torch.equal(got.cpu(), expected)
    assert trips <= 8  # (whisper's own reads of each row's last token, the stop count; 16 and more before)

    counting = [_CountingProcessor(), _CountingProcessor()]
    for m, x, counter in ((model, features, counting[0]), (remote_model, features.cuda(), counting[1])):
        m.generate(x, max_new_tokens=16, eos_token_id=eos, logits_processor=T.LogitsProcessorList([counter]))
    assert counting[1].calls == counting[0].calls


class _Bigram(torch.nn.Module):
    """A model with no Hugging Face in it: logits from the last ids."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16)
        self.out = torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids).cumsum(1)))


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_server_decode_plain_model(remote, sample):
    from remotecuda.decode import server_decode as local_decode  # the same loop, on local tensors
    kw = dict(do_sample=sample, top_k=8, top_p=0.9, temperature=0.7, eos_token_id=[5, 7], pad_token_id=0)
    ids = IDS % 32
    model = _Bigram()
    torch.manual_seed(11)
    local = local_decode(model, ids, 20, **kw)
    model.cuda()
    x = ids.cuda()
    torch.manual_seed(11)
    before = _round_trips()
    out = remotecuda.server_decode(model, x, 20, **kw)
    assert _round_trips() - before <= 1
    assert torch.equal(out.cpu(), local)


def test_server_decode_hf_model_goes_to_generate(remote):
    local, out, trips = _both(_llama(), lambda m, x, a: remotecuda.server_decode(
        m, x, 16, attention_mask=a, pad_token_id=0))
    assert torch.equal(out, local)
    assert trips == 1


def test_beam_search_reads_only_its_stop_check(remote):
    """Beam search decides to stop at every step (one read a step, its own check), but its mask
    and attention reads are answered as in any decode; its tokens are eager's."""
    local, out, trips = _both(_gpt2(), lambda m, x, a: m.generate(
        x, attention_mask=a, max_new_tokens=12, num_beams=2, do_sample=False, pad_token_id=0))
    assert torch.equal(out, local)
    assert 1 < trips <= 12 + 2


def test_known_values_follow_writes(remote):
    """A value read answered by the client (known.py) sees an in-place write, even through a view."""
    from remotecuda import known
    x = torch.tensor([1, 2, 3]).cuda()
    rt = remotecuda.runtime.current()
    assert known.value(x) is not None
    x[1:].fill_(0)  # a write through a view: x's copy is stale now
    assert known.value(x) is None
    rt.dispatcher.propagate = True
    try:
        before = _round_trips()
        y = torch.tensor([4, 5]).cuda()
        assert bool((y == 5).any()) and int(y.sum()) == 9
        assert _round_trips() == before
        assert int(x.sum()) == 1  # (read from the gateway)
        assert _round_trips() == before + 1
    finally:
        rt.dispatcher.propagate = False



def test_known_values_are_copied_to_the_cpu_without_a_read(remote):
    """Inside a decode, ``.tolist()``/``.cpu()`` of known values (Qwen2-VL's ``grid_thw.tolist()`` in
    its vision tower at every ``generate()``) are the client's copy, as an ``.item()`` is; a written
    tensor is fetched."""
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]]).cuda()
    rt = remotecuda.runtime.current()
    rt.dispatcher.propagate = True
    try:
        before = _round_trips()
        merged = grid[:, 1:] // 2
        assert grid.tolist() == [[1, 4, 4], [1, 4, 8]] and torch.equal(merged.t().cpu(), torch.tensor([[2, 2], [2, 4]]))
        assert merged.t().cpu().stride() == (1, 2)  # (a transposed view's strides, as any copy keeps them)
        assert _round_trips() == before
        grid.add_(1)
        assert grid.tolist() == [[2, 5, 5], [2, 5, 9]]  # (read from the gateway)
        assert _round_trips() == before + 1
    finally:
        rt.dispatcher.propagate = False

def test_sampling_after_an_early_stop_draws_as_eager(remote):
    """The steps decoded past eager's stop are undone on the gateway's generator too: what the
    program samples after the call is what it samples after eager's."""
    model = _gpt2()
    torch.manual_seed(5)
    sampled = model.generate(IDS, attention_mask=MASK, max_new_tokens=12, do_sample=True, pad_token_id=0)
    eos = [int(sampled[0, 6 + 1]), int(sampled[1, 6 + 2])]

    def call(m, x, a):
        out = m.generate(x, attention_mask=a, max_new_tokens=40, do_sample=True, pad_token_id=0, eos_token_id=eos)
        after = torch.randint(0, 1 << 30, (4,), device=x.device)
        return torch.cat([out.flatten(), after])
    local, out, _ = _both(model, call, seed=5)
    assert torch.equal(out, local)


def _bart() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, bos_token_id=0)).eval()


def _marian() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.MarianMTModel(T.MarianConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()


@pytest.mark.parametrize("arch", [_bart, _marian], ids=["bart", "marian"])
def test_float_masks_made_on_the_device_are_known(remote, arch):
    """BART's and Marian's decoders make their mask with ``torch.ones(..., device=...)``, a float
    tensor, and ask at every step whether it is all ones: it is known (exact), so greedy decoding
    waits once per call, not once per token (14 for 12 tokens)."""
    local, out, trips = _both(arch(), lambda m, x, a: m.generate(x, attention_mask=a, max_new_tokens=12,
                                                                 do_sample=False))
    assert torch.equal(out, local)
    assert trips <= 2


def test_known_floats_are_only_exact_ones(remote):
    """Floats made from a scalar, cast, moved and compared are known; arithmetic on them, and a
    cast to an integer type out of range (each device has its own answer), is read from the gateway."""
    rt = remotecuda.runtime.current()
    rt.dispatcher.propagate = True
    try:
        before = _round_trips()
        m = torch.ones(2, 3, device="cuda")
        z = torch.zeros(2, 1, dtype=torch.bfloat16, device="cuda")
        assert bool(m.bool().all()) and not bool(torch.cat([m, z.float()], 1).eq(1).all())
        assert float(m[1, 2]) == 1.0 and int(m.long().sum()) == 6
        assert _round_trips() == before
        assert float((m * 0.1).sum()) == pytest.approx(0.6)  # (rounding: read from the gateway)
        assert _round_trips() == before + 1
        big = torch.full((2,), 1e30, device="cuda").long()
        from remotecuda import known
        assert known.value(big) is None and known.value(big.float()) is None
        assert known.value(torch.full((2,), -2.5, device="cuda").int()) is not None
    finally:
        rt.dispatcher.propagate = False
