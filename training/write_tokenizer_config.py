"""Write muse-tiny's ``tokenizer_config.json`` (the ``tokenizer.json`` beside it is left as it is).

It makes ``AutoTokenizer.from_pretrained("musecore/data/muse-tiny")`` work (transformers has no
tokenizer mapping for ``muse_spark``, so the class is named) and gives the special tokens their
roles: ``<|start|>`` BOS, ``<|eot|>`` EOS, ``<|pad|>`` padding, and the multimodal placeholders
under the attribute names ``MuseSparkProcessor`` looks up (``image_token``, ``video_token``,
``audio_token``). ``tokenizer.json`` has no post-processor and transformers 5 ignores
``add_bos_token`` when a ``tokenizer.json`` is present, so plain ``tokenizer(text)`` adds no BOS:
prepend ``<|start|>`` (id 0) for completions, as every training document began with it. The chat
template writes its own ``<|start|>`` markers.

Chat format, kept simple and built only from this tokenizer's special tokens (ids 0-7)::

    <|start|>{role}<|message|>{content}<|eot|>      one per message
    <|start|>assistant<|message|>                    the generation prompt

``content`` is a string, or a list of parts in transformers' multimodal form: ``{"type": "text",
"text": ...}`` parts are written out, ``image``/``video``/``audio`` parts become one
``<|image|>``/``<|video|>``/``<|audio|>`` placeholder each (the processor expands placeholders;
the muse-tiny towers are untrained). Generation stops on ``<|eot|>`` (3) or ``<|eom|>`` (2)
(``generation_config.json``). muse-tiny was trained on Python source only, never on chat; the
template defines the format, it does not make the model a chat model.

Usage::

    python training/write_tokenizer_config.py musecore/data/muse-tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start|>' + message['role'] + '<|message|>' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'video', 'audio'] -%}{{- '<|' + part['type'] + '|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant<|message|>' -}}{%- endif -%}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "TokenizersBackend",
    "bos_token": "<|start|>",
    "eos_token": "<|eot|>",
    "pad_token": "<|pad|>",
    "image_token": "<|image|>",
    "video_token": "<|video|>",
    "audio_token": "<|audio|>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "padding_side": "left",
    "chat_template": CHAT_TEMPLATE,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="the checkpoint folder (holds tokenizer.json)")
    args = parser.parse_args()
    path = args.dest / "tokenizer_config.json"
    path.write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
