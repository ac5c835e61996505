"""A character-level Hugging Face tokenizer built from a character set, with no download.

One token per character (a WordLevel model over single characters behind a pre-tokenizer
that isolates every character), a Fuse decoder so `decode()` joins tokens with no spaces,
and the special tokens <pad>, <bos>, <eos> and <unk>. No token is added automatically:
`tokenizer(text)` gives exactly one id per character. The tiny model builder uses it; the
result saves with `save_pretrained` and reloads with `AutoTokenizer` (local_files_only).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
# special tokens take the first ids, in this order: pad 0, bos 1, eos 2, unk 3
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def build_char_tokenizer(characters: str) -> PreTrainedTokenizerFast:
    """A tokenizer with one id per distinct character of `characters`, after the specials."""
    distinct_characters = list(dict.fromkeys(characters))
    if not distinct_characters:
        raise ValueError("build_char_tokenizer needs at least one character.")
    vocabulary = {token: token_id for token_id, token in enumerate([*SPECIAL_TOKENS, *distinct_characters])}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=UNK_TOKEN))
    # Oniguruma syntax: (?m) lets "." match newlines too, so every character is its own piece
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
