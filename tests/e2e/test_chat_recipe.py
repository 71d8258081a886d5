"""The README recipe end to end: a Hugging Face directory and a conversations file -> `data prepare --format
chat` -> `train` (loss on the assistant's tokens) -> `export-hf` -> transformers `generate` with the chat
template, stopping at the template's end-of-turn token."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the conversation generator

from test_chat_training import many_conversations, write_jsonl  # noqa: E402

import hf_tiny  # noqa: E402
from chat_fixtures import TEMPLATES, tokenizer_dir  # noqa: E402
from hf_tiny import architecture_args  # noqa: E402
from moetrain import cli  # noqa: E402


def test_prepare_train_export_generate_with_the_chat_template(job_args, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tokenizer_dir(tmp_path / "qwen3", TEMPLATES["qwen_chatml"])
    special = json.loads((directory / "config.json").read_text())
    hf_tiny.build("qwen3_moe", seed=4, vocab_size=512, **special).save_pretrained(directory)
    # a task with an answer to learn: the assistant repeats the user's words in upper case
    conversations = [[m if m["role"] != "assistant" else {**m, "content": c[i - 1]["content"].upper()}
                      for i, m in enumerate(c)] for c in many_conversations(300, seed=7)]
    source = write_jsonl(tmp_path / "chats.jsonl", conversations)
    shards, run_dir, out = tmp_path / "shards", tmp_path / "run", tmp_path / "export"
    assert cli.main(["data", "prepare", "--input", str(source), "--out", str(shards), "--tokenizer", str(directory),
                     "--format", "chat", "--quiet"]) == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    argv = [*job_args(run_dir, train__steps=40, checkpoint__every=40, train__eval_every=20, train__eval_batches=50,
                      train__lr=0.003, train__warmup_steps=4, train__microbatch_size=4, train__grad_accum=1,
                      data__source="tokens", data__path=str(shards), data__seq_len=64, data__heldout_fraction=0.05,
                      model__max_seq_len=64),
            *architecture_args(directory), "--model.init_from", f"hf:{directory}", "--data.tokenizer", str(directory)]
    assert cli.main(["train", *argv]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    # held-out loss is measured on the assistant's tokens only: every held-out target is one of them
    assert evals[-1]["heldout_tokens"] == manifest["chat"]["loss_tokens"]["heldout"]
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"] if len(evals) > 1 else True
    print(f"recipe: {manifest['train_documents']} + {manifest['heldout_documents']} conversations, "
          f"{manifest['chat']['loss_tokens']['train']} + {manifest['chat']['loss_tokens']['heldout']} assistant "
          f"tokens; train loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}; held-out "
          + " -> ".join(f"{e['heldout_loss']:.3f} (step {e['step']})" for e in evals))
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "blue sky"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    reply = tok.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=False)
    print(f"recipe: reply to 'blue sky': {reply!r}")
    assert prompt["input_ids"].shape[1] < generated.shape[1]
    eos = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
