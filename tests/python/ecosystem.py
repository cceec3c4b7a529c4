"""The Hugging Face and TensorBoard libraries' side of tests/test_ecosystem.cpp.

Each command does one thing with the real library (pinned in
requirements-dev.txt) and writes what it found to a file the C++ test
compares with noloco's own reading: nothing here decides whether a test
passes. No network: every model is made here from a config, and every file
read was written by the test.
"""
import argparse
import json

import torch


def save_llama(args):
    """A small random Llama that transformers itself saves, and its logits on `ids`."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if args.llama3_rope:
        rope.update(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=args.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=args.tied,
                         rope_parameters=rope)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size, safe_serialization=True)
    ids = torch.tensor(json.loads(args.ids), dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits.float().contiguous()
    save_file({"logits": logits}, f"{args.out}/expected_logits.safetensors")


def logits(args):
    """The logits transformers computes on `ids` with the directory noloco exported."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    ids = torch.tensor(json.loads(args.ids), dtype=torch.long)
    with torch.no_grad():
        out = model(ids).logits.float().contiguous()
    save_file({"logits": out}, args.out)


def generate(args):
    """Greedy continuation of a prompt, printed as `noloco generate DIR temperature=0` prints it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(tokenizer.decode(out[0], skip_special_tokens=False, clean_up_tokenization_spaces=False))


def train_bpe(args):
    """A byte-level BPE trained by the tokenizers library, as Llama 3's and GPT-2's are built."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([args.corpus], trainer)
    tokenizer.save(args.out)


def encode(args):
    """Each text's ids under the tokenizers library."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(args.tokenizer)
    with open(args.texts, encoding="utf-8") as f:
        texts = json.load(f)
    ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    with open(args.out, "w") as f:
        json.dump(ids, f)


def read_safetensors(args):
    """Each tensor's dtype, shape and float64 sum, as safetensors opens the file."""
    from safetensors import safe_open

    found = {}
    with safe_open(args.file, framework="pt") as f:
        metadata = f.metadata() or {}
        for name in f.keys():
            t = f.get_tensor(name)
            found[name] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                           "sum": t.double().sum().item()}
    with open(args.out, "w") as out:
        json.dump({"tensors": found, "metadata": metadata}, out)


def read_events(args):
    """Every event file in a folder as TensorBoard reads it, each record's CRCs checked (a bad one
    raises): its file_version, and its scalars by tag as [step, value] pairs."""
    import glob
    import os

    from tensorboard.compat import tf
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

    found = {"file_versions": [], "scalars": {}}
    for path in sorted(glob.glob(os.path.join(args.logdir, "events.out.tfevents.*"))):
        reader = pywrap_tensorflow.PyRecordReader_New(tf.compat.as_bytes(path), 0)
        while True:
            try:
                reader.GetNext()
            except tf.errors.OutOfRangeError:
                break
            event = event_pb2.Event.FromString(reader.record())
            if event.HasField("file_version"):
                found["file_versions"].append(event.file_version)
            for value in event.summary.value:
                found["scalars"].setdefault(value.tag, []).append([event.step, value.simple_value])
    with open(args.out, "w") as f:
        json.dump(found, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("save_llama")
    p.add_argument("out")
    p.add_argument("--ids", required=True)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--llama3-rope", action="store_true")
    p.add_argument("--max-shard-size", default="10GB")
    p.add_argument("--max-positions", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=save_llama)
    p = commands.add_parser("logits")
    p.add_argument("dir")
    p.add_argument("--ids", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(run=logits)
    p = commands.add_parser("generate")
    p.add_argument("dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--out", required=True)
    p.set_defaults(run=generate)
    p = commands.add_parser("train_bpe")
    p.add_argument("corpus")
    p.add_argument("--vocab", type=int, default=600)
    p.add_argument("--out", required=True)
    p.set_defaults(run=train_bpe)
    p = commands.add_parser("encode")
    p.add_argument("tokenizer")
    p.add_argument("--texts", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(run=encode)
    p = commands.add_parser("read_safetensors")
    p.add_argument("file")
    p.add_argument("--out", required=True)
    p.set_defaults(run=read_safetensors)
    p = commands.add_parser("read_events")
    p.add_argument("logdir")
    p.add_argument("--out", required=True)
    p.set_defaults(run=read_events)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
