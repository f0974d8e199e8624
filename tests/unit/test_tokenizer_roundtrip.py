"""A saved character tokenizer loads back as it was saved, wherever the system loads one (warm-start
cache, checkpoints, evaluation): the same ids for text with spaces and newlines. transformers'
AutoTokenizer alone does not (the control): next to the tiny model's Qwen2 config it builds a
byte-level tokenizer that drops them."""

import transformers

from areal_core.eval.harness import load_tokenizer as eval_tokenizer
from areal_core.models.config import TinyArch
from areal_core.models.loading import load_hf_folder
from areal_core.models.tiny import build_tiny
from areal_core.models.tokenizer import build_char_tokenizer, load_tokenizer
from areal_core.models.warmstart import _load
from areal_core.storage import CheckpointStore

TEXTS = ["> a3b5=", "def f(x, y): return x*(8-5) + 5", "wrong; again:\n a1=1|1", "Q: <py>1 + 2</py>\n<out>3</out>"]


def test_saved_char_tokenizer_encodes_as_built(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny(
        TinyArch(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), tok, seed=0
    )
    url = CheckpointStore(f"file://{tmp_path}/ckpt").publish(0, model, tok)
    folder = url.replace("file://", "")
    want = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    loaded = {
        "load_tokenizer": load_tokenizer(folder),
        "checkpoint": load_hf_folder(url)[1],
        "evaluation": eval_tokenizer(url),
        "warm-start cache": _load(folder)[1],
    }
    for where, t in loaded.items():
        assert [t.encode(x, add_special_tokens=False) for x in TEXTS] == want, where
        assert (t.pad_token_id, t.eos_token_id) == (tok.pad_token_id, tok.eos_token_id), where
        assert t.decode(want[1]) == TEXTS[1], where
    # the control: what AutoTokenizer makes of the same folder loses the spaces and newlines
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    assert [auto.encode(x, add_special_tokens=False) for x in TEXTS] != want
