"""Chat templates and tokenizer directories for the conversation tests, built here (nothing downloaded).

Three template styles: ChatML as Qwen2.5 writes it (a default system prompt, no generation markers),
Llama-3-style headers (BOS from the template, `<|eot_id|>` ends a turn), and ChatML with
`{% generation %}` markers (as SmolLM3 / transformers' documentation write them). `tokenizer_dir`
writes a byte-level BPE tokenizer.json with the templates' special tokens as added tokens, plus
tokenizer_config.json (special tokens, chat template) and config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN_CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

LLAMA3_GENERATION = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEMPLATES = {"qwen_chatml": QWEN_CHATML, "llama3": LLAMA3, "llama3_generation": LLAMA3_GENERATION,
             "chatml_generation": CHATML_GENERATION}

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue"},
     {"role": "user", "content": "And grass?"}, {"role": "assistant", "content": "Green", "tool_calls": None},
     {"role": "user", "content": "Snow? 日本語 🙂"}, {"role": "assistant", "content": " White \n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Nothing."}],
]


def tokenizer_dir(directory: Path, template: str | None, train_text: list[str] | None = None,
                  bos: str = "<|begin_of_text|>", eos: str = "<|im_end|>", vocab_size: int = 400,
                  jinja_file: bool = False) -> Path:
    """A byte-level BPE tokenizer directory whose added special tokens are SPECIAL."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = train_text or [m["content"] for c in CONVERSATIONS for m in c] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": "<|endoftext|>", "model_max_length": 1 << 20}
    if template is not None and not jinja_file:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None and jinja_file:
        (directory / "chat_template.jinja").write_text(template)
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    (directory / "config.json").write_text(json.dumps({"bos_token_id": ids[bos], "eos_token_id": ids[eos],
                                                       "pad_token_id": ids["<|endoftext|>"]}))
    return directory
