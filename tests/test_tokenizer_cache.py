"""A GGUF's tokenizer is converted once and loaded from its saved copy afterwards."""

from __future__ import annotations

import json
import os

from pagedserve.models.loader import ModelSource, load_tokenizer, tokenizer_cache_dir

TEXT = "Hello, wörld! <|im_start|>user\nhi<|im_end|> 日本 ...   spaces\tand tabs"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_the_saved_tokenizer_is_the_converted_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = ModelSource.resolve(None)
    cached = tokenizer_cache_dir(source)
    assert cached.startswith(str(tmp_path)) and not os.path.exists(cached)
    converted = load_tokenizer(source)
    assert os.path.exists(os.path.join(cached, "tokenizer.json"))
    saved = load_tokenizer(source)
    assert saved.name_or_path == cached  # loaded from the copy, not the GGUF
    assert saved.encode(TEXT) == converted.encode(TEXT)
    ids = converted.encode(TEXT)
    assert saved.decode(ids, skip_special_tokens=True) == converted.decode(
        ids, skip_special_tokens=True
    )
    assert saved.eos_token_id == converted.eos_token_id and len(saved) == len(converted)
    # The added tokens come from tokenizer_config.json (no parse of tokenizer.json for them),
    # the same ones with the same flags.
    with open(os.path.join(cached, "tokenizer_config.json"), encoding="utf-8") as f:
        assert len(json.load(f)["added_tokens_decoder"]) == len(converted.added_tokens_decoder)

    def added(tokenizer) -> dict:
        return {i: t.__getstate__() for i, t in tokenizer.added_tokens_decoder.items()}

    assert added(saved) == added(converted)
    assert saved.special_tokens_map == converted.special_tokens_map
    assert saved.all_special_ids == converted.all_special_ids
    for prompt in (True, False):
        assert saved.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=prompt
        ) == converted.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
