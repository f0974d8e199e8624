"""A one-token-per-character tokenizer for the tiny model and the synthetic task.

Built with the ``tokenizers`` library (WordLevel model over single characters,
a pre-tokenizer that isolates every character, a decoder that fuses tokens
back without separators) and wrapped as a transformers fast tokenizer, so it
saves with ``save_pretrained``. Load a saved one with :func:`load_tokenizer`, not
``transformers.AutoTokenizer``: next to the tiny model's config.json (a Qwen2 architecture)
AutoTokenizer builds a Qwen2Tokenizer, whose byte-level pre-tokenizer replaces this one's and
drops every space and newline when it encodes.
"""

from __future__ import annotations

import json
import os
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<pad>"
EOS = "<eos>"
UNK = "<unk>"

# Order matters: ids are part of a saved model. pad=0, eos=1, then characters.
CHARS = string.digits + string.ascii_lowercase + "=|+-,:#> " + string.ascii_uppercase + ".?!*/()[]<_'\"\n"


def char_vocab() -> dict[str, int]:
    vocab = {PAD: 0, EOS: 1}
    for ch in CHARS:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    vocab[UNK] = len(vocab)
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return the character tokenizer (pad id 0, eos id 1, no chat template)."""
    tok = Tokenizer(models.WordLevel(char_vocab(), unk_token=UNK))
    # [\s\S] matches any single character, newline included.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def load_tokenizer(folder: str, **kwargs):
    """The tokenizer saved in ``folder`` (a local folder), as it was saved: the character tokenizer (a
    WordLevel ``tokenizer.json``) as the fast tokenizer it is, anything else through
    ``transformers.AutoTokenizer`` (see the module docstring for why not always the latter)."""
    from transformers import AutoTokenizer

    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        with open(path) as f:
            if json.load(f).get("model", {}).get("type") == "WordLevel":
                return PreTrainedTokenizerFast.from_pretrained(folder, **kwargs)
    return AutoTokenizer.from_pretrained(folder, **kwargs)
