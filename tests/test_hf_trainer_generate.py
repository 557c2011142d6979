"""Hugging Face usage beyond tests/test_hf_more.py, on 'cuda' against the local CPU (tiny configs,
no hub): the ``Trainer`` choosing the device by itself, with gradient accumulation, evaluation and
checkpoints every few steps, the best model loaded at the end, ``predict``, and a second run
resumed from a checkpoint (its RNG states and optimizer restored on the device); a
``Seq2SeqTrainer`` evaluating with ``generate()`` and beams; and ``generate()`` variants that take
transformers' plain path: an assistant model, prompt lookup, a ``DynamicCache`` reused across
calls, ``inputs_embeds``, precomputed ``encoder_outputs``, beam transition scores."""
from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from local_parity import assert_matches_local, registry

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()

IDS = torch.randint(1, 50, (24, 10), generator=torch.Generator().manual_seed(1))
LABELS = torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(2))
PROMPTS = torch.tensor([[5, 9, 14, 3, 7], [0, 0, 0, 7, 8], [0, 0, 21, 30, 40]])


class _Rows(torch.utils.data.Dataset):
    """Examples as Python lists, as a ``datasets`` map would give them."""

    def __init__(self, rows: slice):
        self.ids, self.labels = IDS[rows].tolist(), LABELS[rows].tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.BertForSequenceClassification(T.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _accuracy(p: object) -> dict:
    return {"acc": float((p.predictions.argmax(-1) == p.label_ids).mean())}


@case
def trainer_eval_checkpoints_resume(dev):
    with tempfile.TemporaryDirectory() as out:
        return _train_evaluate_resume(dev, out)


def _train_evaluate_resume(dev: str, out: str) -> tuple:
    common = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                  seed=0, report_to=[], disable_tqdm=True, logging_steps=1, use_cpu=dev == "cpu")
    args = T.TrainingArguments(**common, max_steps=2, eval_strategy="steps", eval_steps=1, save_steps=1,
                               load_best_model_at_end=True, metric_for_best_model="acc", per_device_eval_batch_size=5)
    assert (str(args.device), args.n_gpu) == (("cpu", 0) if dev == "cpu" else ("cuda:0", 1))
    trainer = T.Trainer(model=_classifier(), args=args, train_dataset=_Rows(slice(16)),
                        eval_dataset=_Rows(slice(16, 24)), compute_metrics=_accuracy)
    trainer.train()
    assert next(trainer.model.parameters()).device.type == dev
    evaluated, predicted = trainer.evaluate(), trainer.predict(_Rows(slice(16, 24)))
    resumed = T.Trainer(model=_classifier(), args=T.TrainingArguments(**common, max_steps=3, save_strategy="no"),
                        train_dataset=_Rows(slice(16)))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    logged = [h["loss"] for t in (trainer, resumed) for h in t.state.log_history if "loss" in h]
    return (torch.tensor(logged), torch.tensor([evaluated["eval_loss"], evaluated["eval_acc"]]),
            torch.from_numpy(predicted.predictions), int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1]),
            resumed.model.classifier.weight)


@case
def seq2seq_trainer_predicts_with_beams(dev):
    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, dropout_rate=0.0))
    rows = [{"input_ids": r[:4 + i % 5], "labels": r[:3][::-1] + [1]} for i, r in enumerate(IDS[:12].tolist())]

    def collate(batch: list) -> dict:
        def pad(key: str, value: int) -> torch.Tensor:
            n = max(len(b[key]) for b in batch)
            return torch.tensor([b[key] + [value] * (n - len(b[key])) for b in batch])
        ids = pad("input_ids", 0)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": pad("labels", -100)}
    args = T.Seq2SeqTrainingArguments(
        output_dir="unused", max_steps=3, per_device_train_batch_size=4,
        per_device_eval_batch_size=5, predict_with_generate=True, generation_max_length=6, generation_num_beams=2,
        learning_rate=1e-2, seed=0, report_to=[], disable_tqdm=True, save_strategy="no", use_cpu=dev == "cpu")
    trainer = T.Seq2SeqTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=collate)
    trainer.train()
    predicted = trainer.predict(rows)
    return torch.from_numpy(predicted.predictions), torch.tensor(predicted.metrics["test_loss"])


def _llama(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()


@case
def assisted_and_prompt_lookup_decoding(dev):
    model, assistant = _llama().to(dev), _llama(1).to(dev)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9]], device=dev)
    return (model.generate(ids, assistant_model=assistant, max_new_tokens=8, do_sample=False),
            model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False))


@case
def dynamic_cache_reused_across_calls(dev):
    model = _llama().to(dev)
    prefix = torch.tensor([[5, 9, 14, 3]], device=dev)
    with torch.no_grad():
        cache = model(prefix, past_key_values=T.DynamicCache(config=model.config)).past_key_values
    found = []
    for suffix in ([7, 8], [20]):
        ids = torch.cat([prefix, torch.tensor([suffix], device=dev)], 1)
        found.append(model.generate(ids, past_key_values=copy.deepcopy(cache), max_new_tokens=4, do_sample=False))
    out = model.generate(prefix, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([out.sequences, torch.tensor([[7]], device=dev)], 1)
    found.append(model.generate(more, past_key_values=out.past_key_values, max_new_tokens=3, do_sample=False))
    return found


@case
def inputs_embeds_and_transition_scores(dev):
    model, ids = _llama().to(dev), PROMPTS.to(dev)
    mask = (ids != 0).long()
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask,
                                 max_new_tokens=4, do_sample=False)
    out = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=4,
                         output_scores=True, return_dict_in_generate=True)
    scores = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    return from_embeds, out.sequences, scores, out.sequences_scores


@case
def bart_generate_from_encoder_outputs(dev):
    torch.manual_seed(0)
    model = T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=1)).to(dev).eval()
    ids = torch.tensor([[5, 9, 14, 3, 7, 2], [7, 8, 21, 2, 0, 0]], device=dev)
    mask = (ids != 0).long()
    encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)
    return (model.generate(encoder_outputs=encoded, attention_mask=mask, max_new_tokens=5, num_beams=2),
            model.generate(ids, attention_mask=mask, decoder_input_ids=torch.tensor([[2, 1, 9]] * 2, device=dev),
                           max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("name", list(CASES))
def test_hf_program_matches_local(name):
    assert_matches_local(CASES[name])
