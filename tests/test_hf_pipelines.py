"""Hugging Face ``pipeline(..., device=0)`` and streamed generation on 'cuda' give the local CPU's
answers: token labels grouped into entities, masked-word candidates, zero-shot labels, features,
batched left-padded text generation, CTC speech recognition, and a ``TextIteratorStreamer`` read
while ``generate()`` runs in a thread (as chat demos do). Tokenizers are built offline (a word-level
``tokenizers.Tokenizer`` wrapped in ``PreTrainedTokenizerFast``); models from tiny configs."""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.usefixtures("remote")

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "is", "was", "where", "big", "small", "red", "blue", "it",
         "and", "to", "in", "city"]


def _bert_tokenizer() -> T.PreTrainedTokenizerFast:
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(special + WORDS)},
                                                          unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                     sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)


def _causal_tokenizer() -> T.PreTrainedTokenizerFast:
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                     eos_token="</s>", padding_side="left")


BERT = dict(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64)
LABELS = dict(id2label={0: "O", 1: "B-X", 2: "I-X"}, label2id={"O": 0, "B-X": 1, "I-X": 2})
NLI = dict(id2label={0: "contradiction", 1: "neutral", 2: "entailment"},
           label2id={"contradiction": 0, "neutral": 1, "entailment": 2})
W2V = dict(vocab_size=12, pad_token_id=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
           num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, layerdrop=0.0, mask_time_prob=0.0,
           do_stable_layer_norm=True, feat_extract_norm="layer")
WAVE = np.random.RandomState(0).randn(1600).astype(np.float32)


def _llama() -> torch.nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=4 + len(WORDS), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _ctc_tokenizer(tmp_path: str) -> T.Wav2Vec2CTCTokenizer:
    vocab = os.path.join(tmp_path, "vocab.json")
    with open(vocab, "w") as f:
        json.dump({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4, **{c: i + 5 for i, c in enumerate("abcdefg")}},
                  f)
    return T.Wav2Vec2CTCTokenizer(vocab)


def _features() -> T.Wav2Vec2FeatureExtractor:
    return T.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                      return_attention_mask=True)


#: task, the model, the pipeline's processors (given a tmp dir), the call
PIPELINES: dict[str, tuple[str, Callable, Callable, Callable]] = {
    "ner_grouped": ("token-classification", lambda: T.BertForTokenClassification(T.BertConfig(**BERT, **LABELS)),
                    lambda _: dict(tokenizer=_bert_tokenizer()),
                    lambda p: p("the big red cat sat on the mat", aggregation_strategy="simple")),
    "fill_mask": ("fill-mask", lambda: T.BertForMaskedLM(T.BertConfig(**BERT)),
                  lambda _: dict(tokenizer=_bert_tokenizer()), lambda p: p("the cat [MASK] on the mat", top_k=3)),
    "zero_shot": ("zero-shot-classification",
                  lambda: T.BertForSequenceClassification(T.BertConfig(**BERT, **NLI)),
                  lambda _: dict(tokenizer=_bert_tokenizer()),
                  lambda p: p(["the cat sat on the mat", "a dog"], candidate_labels=["city", "dog", "red"],
                              hypothesis_template="it is {}", multi_label=True)),
    "features": ("feature-extraction", lambda: T.BertModel(T.BertConfig(**BERT)),
                 lambda _: dict(tokenizer=_bert_tokenizer()),
                 lambda p: p("the cat sat on the mat", return_tensors=True)),
    "text_generation": ("text-generation", _llama, lambda _: dict(tokenizer=_causal_tokenizer()),
                        lambda p: p(["the cat sat", "a big red dog is in the city"], max_new_tokens=6,
                                    do_sample=False, batch_size=2)),
    "speech_ctc": ("automatic-speech-recognition", lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(**W2V)),
                   lambda tmp: dict(tokenizer=_ctc_tokenizer(tmp), feature_extractor=_features()),
                   lambda p: p([WAVE, WAVE[:800]], batch_size=2)),
}


def _plain(x: object) -> object:
    """The answer with its tensors and numpy scalars as lists and floats, to compare."""
    if isinstance(x, torch.Tensor):
        assert x.device.type == "cpu"  # (a pipeline's results are always the CPU's)
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_on_device_0_matches_local(name, tmp_path):
    task, make, processors, call = PIPELINES[name]
    answers = []
    for device in ("cpu", 0):
        torch.manual_seed(0)
        pipe = T.pipeline(task, model=make().eval(), device=device, **processors(str(tmp_path)))
        assert pipe.device.type == ("cpu" if device == "cpu" else "cuda")
        answers.append(_plain(call(pipe)))
    local, got = answers
    _assert_same(got, local, name)


def _assert_same(got: object, expected: object, where: str) -> None:
    """Equal, but floats within float32's reduction differences."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-5), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for k in expected:
            _assert_same(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_same(g, e, f"{where}[{i}]")
    else:
        assert got == expected, where


def test_iterator_streamer_with_generate_in_a_thread():
    """Chat demos run ``generate(streamer=TextIteratorStreamer(...))`` in a thread and read the
    text as it comes: the pieces are eager's."""
    tok = _causal_tokenizer()
    torch.manual_seed(0)
    model = _llama().eval()
    pieces = []
    for dev in ("cpu", "cuda"):
        model.to(dev)
        streamer = T.TextIteratorStreamer(tok, skip_prompt=True)
        ids = tok(["the cat sat on"], return_tensors="pt").input_ids.to(dev)
        worker = threading.Thread(target=model.generate, kwargs=dict(
            input_ids=ids, max_new_tokens=8, do_sample=False, streamer=streamer))
        worker.start()
        pieces.append(list(streamer))
        worker.join()
    assert pieces[1] == pieces[0] and "".join(pieces[0]).strip()


def test_a_batch_comes_back_to_the_cpu_in_one_round_trip():
    """A pipeline moves each batch's outputs, and the inputs its postprocessing reads, to the CPU
    one ``.to('cpu')`` at a time (token classification: logits, ids, offsets, masks): they are
    fetched together, so a batch waits twice (that and the mask's all-ones check), not seven times."""
    import remotecuda
    texts = ["the big red cat sat on the mat", "a dog", "where is it", "the small blue city"]
    answers = []
    for device in ("cpu", 0):
        torch.manual_seed(0)
        model = T.BertForTokenClassification(T.BertConfig(**BERT, **LABELS)).eval()
        pipe = T.pipeline("token-classification", model=model, tokenizer=_bert_tokenizer(), device=device)
        pipe(texts, batch_size=4)  # (the first call on 'cuda' also asks for the attention backend)
        remotecuda.stats(reset=True)
        answers.append(_plain(pipe(texts, batch_size=4)))
    assert remotecuda.stats()["blocking_round_trips"] == 2
    _assert_same(answers[1], answers[0], "token-classification")
