"""A llama-architecture GGUF file (llama.cpp's format) read into the book's one weight layout.

GGUF keeps a model's hyperparameters, its tokenizer and chat template as key-value metadata,
then its tensors, each in a number format of its own (ggml's block quantizations among them).
`read` checks the architecture, maps every tensor to the book's names and (in, out) layout
(model.config.weight_shapes), and dequantizes F32, F16, Q8_0, Q4_0 and Q4_1 to float32 through
ggml's own `gguf` package. Two things the conversion from Hugging Face did are undone here:
llama.cpp stores each query and key matrix with its rows reordered for its RoPE, which rotates
adjacent pairs where the book (and Hugging Face) rotate the two halves of a head; and a model
with tied embeddings has no output matrix, so the LM head is the embedding table transposed.

Shapes: d model width, H query heads, K KV heads, Dh head size, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infra_lab.model.config import ModelConfig, weight_shapes

ARCHITECTURE = "llama"
FORMATS = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")  # number formats dequantized here (gguf.GGMLQuantizationType)
NAMES = {  # GGUF tensor name (per layer: "blk.{i}.") -> the book's (per layer: "layers.{i}.")
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}


@dataclass(frozen=True)
class GGUFModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # the book's names and layout, float32
    formats: dict[str, str]  # the book's weight name -> the number format the file stored it in
    tokenizer: dict  # the file's tokenizer: "model", "pre", "tokens", "merges", special token ids
    chat_template: str | None  # jinja2, as transformers renders it
    path: Path


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of llama.cpp's reordering of a query or key matrix's output rows (n_heads x Dh,
    n_in): within each head, its rows were interleaved (the first half's row i beside the second
    half's row i) so that RoPE can rotate adjacent pairs; this puts the halves back."""
    rows, n_in = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, n_in).swapaxes(1, 2).reshape(rows, n_in)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read(path: str | Path, name: str | None = None) -> GGUFModel:
    """The model in the GGUF file at `path`: its config (named `name`, or the file's base name),
    float32 weights in the book's layout, the formats they were stored in, its tokenizer and chat
    template. A file that is missing, cut short, of another architecture, with a number format not
    in FORMATS, or with a tensor of the wrong shape raises by name."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader's own errors (struct, value, index) all mean a bad file
        raise ValueError(f"{path} is not a readable GGUF file ({type(error).__name__}: {error}); it may be cut "
                         "short: fetch it again") from None
    arch = _field(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(f"{path.name} holds a {arch!r} model; this reader knows the {ARCHITECTURE!r} architecture")
    key = lambda k: _field(reader, f"{ARCHITECTURE}.{k}")  # noqa: E731
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    config = ModelConfig(
        name or path.stem, n_layers=int(key("block_count")), d_model=int(key("embedding_length")),
        n_heads=int(key("attention.head_count")), n_kv_heads=int(key("attention.head_count_kv")),
        d_ff=int(key("feed_forward_length")), vocab=int(vocab), context=int(key("context_length")),
        rope_theta=float(key("rope.freq_base") or 10000.0), source=str(path.name),
        norm_eps=float(key("attention.layer_norm_rms_epsilon") or 1e-5),
        tied_embeddings=not any(t.name == "output.weight" for t in reader.tensors))
    if key("rope.dimension_count") not in (None, config.head_dim):
        raise ValueError(f"{path.name} rotates {key('rope.dimension_count')} of each head's {config.head_dim} "
                         "dimensions; the book's RoPE rotates all of them")
    weights, formats = {}, {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in FORMATS:
            raise ValueError(f"{path.name}: tensor {tensor.name} is stored as {kind}; this reader dequantizes "
                             f"{', '.join(FORMATS)}")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        try:
            array = np.array(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)  # a copy:
            # float32 tensors come back as read-only views of the mapped file
        except ValueError as error:
            raise ValueError(f"{path.name}: tensor {tensor.name} cannot be read as {kind} of shape {shape} ({error}); "
                             "the file may be cut short") from None
        ours = _our_name(tensor.name, config)
        weights[ours], formats[ours] = _our_layout(ours, array, config), kind
    if config.tied_embeddings:
        weights["lm_head"], formats["lm_head"] = weights["embed"].T, formats["embed"]  # a view: one table
    expected = weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    wrong = [f"{n} is {weights[n].shape}, expected {s}" for n, s in expected.items()
             if n in weights and weights[n].shape != s]
    if missing or wrong:
        raise ValueError(f"{path.name} does not hold a whole {ARCHITECTURE} model: "
                         + "; ".join(([f"missing {', '.join(missing)}"] if missing else []) + wrong))
    tokenizer = {"model": _field(reader, "tokenizer.ggml.model"), "pre": _field(reader, "tokenizer.ggml.pre"),
                 "tokens": list(_field(reader, "tokenizer.ggml.tokens")),
                 "merges": list(_field(reader, "tokenizer.ggml.merges") or []),
                 "token_types": list(_field(reader, "tokenizer.ggml.token_type") or []),
                 **{f"{k}_id": _field(reader, f"tokenizer.ggml.{k}_token_id")
                    for k in ("bos", "eos", "unknown", "padding")},
                 "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False))}
    return GGUFModel(config, weights, formats, tokenizer, _field(reader, "tokenizer.chat_template"), path)


def _our_name(gguf_name: str, config: ModelConfig) -> str:
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "final_norm"
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in NAMES \
            and parts[1].isdigit() and int(parts[1]) < config.n_layers:
        return f"layers.{parts[1]}.{NAMES[parts[2]]}"
    raise ValueError(f"tensor {gguf_name!r} is not part of a {ARCHITECTURE} model this reader knows "
                     "(no biases, no mixture of experts)")


def _our_layout(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """GGUF keeps a matrix as (out, in) and the embedding as (V, d); the book multiplies x @ W
    with W (in, out), and rotates the halves of each query and key head."""
    if array.ndim == 1 or name == "embed":
        return np.ascontiguousarray(array)
    if name.endswith(".wq"):
        array = unpermute_rope_rows(array, config.n_heads)
    elif name.endswith(".wk"):
        array = unpermute_rope_rows(array, config.n_kv_heads)
    return np.ascontiguousarray(array.T)
