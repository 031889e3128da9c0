"""The tokenizer: byte-level round trips, chat templates, streaming, and unknown ids."""

import json

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.model.tokenizer import REPLACEMENT_CHAR, Tokenizer, TokenizerError
from support.checkpoints import cached_checkpoint


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(cached_checkpoint("mixtral", "tiny"))


def _stream(tok, ids, context=()):
    detok = tok.detokenizer(context)
    pieces = [detok.push(i) for i in ids]
    return pieces, "".join(pieces) + detok.flush()


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_round_trips_through_bytes(text):
    tok = Tokenizer.from_dir(cached_checkpoint("mixtral", "tiny"))
    ids = tok.encode(text)
    if "<|" not in text:
        assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40).filter(lambda t: "<|" not in t))
def test_streaming_never_splits_a_character(text):
    tok = Tokenizer.from_dir(cached_checkpoint("mixtral", "tiny"))
    pieces, streamed = _stream(tok, tok.encode(text))
    assert streamed == text
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)


def test_multibyte_characters_come_out_whole(tok):
    pieces, _ = _stream(tok, list("é€".encode()))  # 2 + 3 bytes
    assert pieces == ["", "é", "", "", "€"]


def test_specials_are_ids_and_are_skipped_in_text(tok):
    ids = tok.encode("hi<|im_end|>")
    assert ids == [104, 105, 258]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"
    assert tok.eos_token_id == 256 and tok.vocab_size == 260


def test_ids_beyond_the_tokenizer_become_replacement_chars(tok):
    assert tok.decode([104, 260, 50_000, 105]) == "h\ufffd\ufffdi"
    pieces, streamed = _stream(tok, [104, 70_000, 105])
    assert pieces == ["h", REPLACEMENT_CHAR, "i"]  # an unknown id is not held back
    assert streamed == "h\ufffdi"


def test_an_incomplete_character_at_the_end_is_flushed(tok):
    pieces, streamed = _stream(tok, [104, 0xC3])
    assert pieces == ["h", ""]
    assert streamed == "h" + REPLACEMENT_CHAR


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(messages)
    assert ids[0] == 257 and ids[-len("assistant\n") - 1] == 257
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_agrees_with_transformers(tok):
    transformers = pytest.importorskip("transformers")
    ckpt = cached_checkpoint("mixtral", "tiny")
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ça va?"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tok.encode("ça va? <|im_start|>") == hf("ça va? <|im_start|>").input_ids


def _copy_tokenizer(src, dst, **config_changes):
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_template_from_chat_template_jinja_and_dict_tokens(tmp_path):
    src = cached_checkpoint("mixtral", "tiny")
    dst = _copy_tokenizer(src, tmp_path / "t", chat_template=None,
                          bos_token={"content": "<|endoftext|>", "special": True})
    (dst / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(dst)
    assert tok.bos_token_id == 256
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>x"


def test_missing_template_and_template_errors_are_clear(tmp_path):
    src = cached_checkpoint("mixtral", "tiny")
    bare = Tokenizer.from_dir(_copy_tokenizer(src, tmp_path / "bare", chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    raising = _copy_tokenizer(
        src, tmp_path / "raising", chat_template="{{ raise_exception('only user turns') }}"
    )
    with pytest.raises(TokenizerError, match="chat template: only user turns"):
        Tokenizer.from_dir(raising).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_broken_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="could not be read"):
        Tokenizer.from_dir(tmp_path)


def test_sentencepiece_spaces_follow_the_prompt():
    # Metaspace tokenizers (Mixtral's) drop the leading space of the first token decoded alone.
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"▁hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(backend)
    assert tok.decode([1]) == "world"
    assert _stream(tok, [1, 1], context=[0])[1] == " world world"
