"""Tokenizers (Hugging Face ``tokenizers`` backed, or byte-level for ``tiny``) and streaming
detokenization.

Owns: ``Tokenizer`` (encode, decode, chat template, special ids), ``ByteTokenizer``,
``hf_tokenizer_from_gguf_vocab`` and ``IncrementalDetokenizer``.

Imports tokenizers and jinja2 only.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_GGUF_CONTROL_TOKEN = 3
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# GGUF tokenizer.ggml.pre -> the regex that splits text before byte-level BPE (checked against
# llama.cpp's vocabulary tests: tests/test_gguf_families.py)
_SPLITS = {
    "llama-bpe": _LETTERS + r"|\p{N}{1,3}|" + _REST,   # Llama 3
    "qwen2": _LETTERS + r"|\p{N}|" + _REST,           # Qwen2, Qwen2.5, Qwen3
}


def _compile_chat_template(source: str) -> jinja2.Template:
    # The jinja settings, filters and globals Hugging Face transformers renders chat templates
    # with (utils/chat_template_utils.py): Llama 3.x's templates call strftime_now, tool-using
    # ones tojson (not jinja's HTML-escaping one).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one model, over a Hugging Face ``tokenizers.Tokenizer``."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, add_bos_token: bool = False, special_tokens: dict | None = None):
        """``special_tokens``: tokenizer_config.json's named tokens (bos_token, eos_token,
        pad_token, unk_token ...) that a chat template may print, as transformers passes them."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._template = _compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)), **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """A prompt's ids as transformers' ``tokenizer(text)`` gives them: the tokenizer's own
        post-processor (Llama 3's adds its BOS), else BOS when tokenizer_config says so."""
        ids = self.backend.encode(text, add_special_tokens=True).ids
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of a rendered chat, as transformers' ``apply_chat_template(tokenize=True)``:
        no special tokens added, since the template prints its own BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        names = {"bos_token": bos or "", "eos_token": eos or "", **self.special_tokens}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                     documents=None, **names)


def hf_tokenizer_from_gguf_vocab(tokens: list[str], merges: list[str], token_types: list[int],
                                 pre: str) -> HFTokenizer:
    """Rebuild a byte-level BPE (GGUF ``tokenizer.ggml.model == "gpt2"``) tokenizer."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    # Llama 3's BPE takes a whole pre-tokenized word that is in the vocabulary as it is
    # (tokenizer.json's "ignore_merges": true), before trying merges.
    backend = HFTokenizer(models.BPE(vocab, merge_pairs, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=pre == "llama-bpe"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "gpt-2", "default"):
        backend.pre_tokenizer = byte_level
    elif pre in _SPLITS:   # the split regex llama.cpp (llama-vocab.cpp) and the models' tokenizer.json use
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    else:
        raise NotImplementedError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2, "
                                  f"gpt-2, {', '.join(_SPLITS)})")
    backend.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(token_types) if kind == _GGUF_CONTROL_TOKEN]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


class ByteTokenizer(Tokenizer):
    """The ``tiny`` model's tokenizer: ids 0..255 are bytes, 256 = bos, 257 = eos."""

    BOS, EOS = 256, 257
    CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")

    def __init__(self):
        self.backend = None
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)
        self.add_bos_token = False
        self.chat_template = self.CHAT_TEMPLATE
        self._template = _compile_chat_template(self.CHAT_TEMPLATE)

    @property
    def vocab_size(self) -> int:
        return 258

    def token_to_id(self, token: str) -> int | None:
        return {"<bos>": self.BOS, "<eos>": self.EOS}.get(token)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # Bytes are decoded run by run so special tokens can sit between them.
        pieces, run = [], bytearray()
        for token_id in ids:
            if token_id < 256:
                run.append(token_id)
                continue
            pieces.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                pieces.append({self.BOS: "<bos>", self.EOS: "<eos>"}.get(token_id, f"<{token_id}>"))
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


class IncrementalDetokenizer:
    """Streams text one token at a time without splitting multi-byte characters.

    As vLLM does: decode a short window of recent tokens twice (with and without the new
    ones) and emit the difference, holding it back while it ends in U+FFFD (an incomplete
    UTF-8 sequence whose remaining bytes are still to come).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: context that decodes the same either way
        self._read_offset = 0  # tokens before this are already emitted as text
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        new_text = decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At end of stream: whatever was held back (replacement characters included)."""
        held = self.token_ids[self._prefix_offset:self._read_offset]
        prefix_text = self.tokenizer.decode(held, self.skip_special_tokens)
        new_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        if delta:
            self._chunks.append(delta)
        return delta
