"""Give a test model a tokenizer, so that clients that speak text (``vllm bench serve``) can
drive it: one word per token id (``w3`` ... ``w<vocab-1>``), ids 0-2 the unknown, begin and end
tokens. Runs in the vLLM venv (it needs ``tokenizers`` and ``transformers``).

    python -m bench.vllm_tokenizer MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_dir = sys.argv[1]
    with open(os.path.join(model_dir, "config.json")) as fh:
        vocab_size = int(json.load(fh)["vocab_size"])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(model_dir)


if __name__ == "__main__":
    main()
