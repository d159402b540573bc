"""A word-level tokenizer over a tiny model's whole vocabulary, with a chat template, for server
tests: token i is the word `w<i>` (id 1 is `</s>`, the end-of-sequence token of the DeepSeek tiny
configs), so any generated id decodes and any text of such words encodes exactly."""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATE = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                 "{% if add_generation_prompt %}w4{% endif %}")


def tiny_tokenizer(vocab_size: int = 256, eos_id: int = 1) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size) if i != eos_id}
    vocab["</s>"] = eos_id
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    return out
